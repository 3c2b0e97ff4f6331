"""`FSDP2Strategy`: data-parallel `train_on_batch` with torch FSDP2 (`fully_shard`), each
decoder layer a unit of its own; see `rl.distributed` for how the ranks share the batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.training import TrainConfig
from trainer_core.memory import decoder_layers
from trainer_core.models.lora import causal_lm
from trainer_core.rl.distributed import ForwardRunner, ReplicatedCritic, all_reduce, broadcast_object, broadcast_whole
from trainer_core.rl.strategy import ADAM_BETAS, ADAM_EPS, OPTIMIZER_FILE

_T = TypeVar("_T")


class FSDP2Strategy:
    """torch FSDP2 (`fully_shard`): each decoder layer is a unit of its own and the rest of the
    policy (embeddings, final norm, LM head) is the root unit; AdamW steps on the shards.

    Parameters, gradients and AdamW state are sharded over the ranks; a unit's parameters are
    all-gathered for its forward and backward, and its gradients reduce-scattered (averaged)
    after. The policy's parameters become DTensors in place: call `full_state_dict` on every
    rank for whole weights. Every rank must pass the same initial weights (the same checkpoint),
    already on its device (`DistEnv.device`).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        value_head: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        device: torch.device | None = None,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("FSDP2Strategy needs a process group: call init_distributed() first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = device or next(model.parameters()).device
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.model = model
        self._root = _fully_shard(model, mesh)
        # A separate reference model (the KL term's) is sharded the same way: each rank holds
        # 1/world_size of it too. The same `train_on_batch(ref_model=...)` must be passed.
        self._ref_root = _fully_shard(ref_model, mesh) if ref_model is not None else None
        self._actor = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._actor, lr=cfg.learning_rate, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0
        )
        self._max_grad_norm = cfg.max_grad_norm
        self._critic = (
            ReplicatedCritic(value_head, cfg.learning_rate, cfg.max_grad_norm) if value_head is not None else None
        )

    def forward(self, fn: Callable[[], _T]) -> _T:
        return self._root(fn)

    def reference_forward(self, fn: Callable[[], _T]) -> _T:
        # Without a sharded reference model the reference is the policy itself (LoRA, adapter off).
        return (self._ref_root or self._root)(fn)

    def all_reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        return all_reduce(value, op, self.device)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> Tensor:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self._actor if p.grad is not None]
        # Each rank's norm is of its own shards; full_tensor() sums the squares over ranks.
        total_norm = nn.utils.get_total_norm(grads)
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        nn.utils.clip_grads_with_norm_(self._actor, self._max_grad_norm, total_norm)
        if self._critic is not None:
            self._critic.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_norm

    def full_state_dict(self) -> dict[str, Tensor]:
        """The policy's whole parameters by name (a collective: call it on every rank)."""
        from torch.distributed.tensor import DTensor

        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in self.model.named_parameters()
        }

    def load_full_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Copy rank 0's `weights` (whole parameters by name, all or some) into every rank's shards
        in place (a collective: the other ranks may pass {}). One parameter at a time is
        broadcast whole, and each rank keeps its own shard of it."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for param, whole in broadcast_whole(weights, params, self.rank, self.device):
                if isinstance(param, DTensor):
                    # Every rank holds the whole tensor now: each takes its shard, no communication.
                    whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(whole)

    def save_optimizer_state(self, directory: Path) -> None:
        """Write the AdamW state, whole and keyed by parameter name, to `directory/optimizer.pt`
        (a collective: call it on every rank; rank 0 writes). Whole, it loads at any process
        count."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"actor": get_optimizer_state_dict(self.model, self.optimizer, options=options)}
        if self._critic is not None:
            state["critic"] = self._critic.optimizer.state_dict()
        if self.rank == 0:
            torch.save(state, directory / OPTIMIZER_FILE)

    def load_optimizer_state(self, directory: Path) -> None:
        """Load what `save_optimizer_state` wrote (a collective; only rank 0 reads the file, and
        each rank takes its shards of the state)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = torch.load(directory / OPTIMIZER_FILE, weights_only=True) if self.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state.get("actor", {}), options=options)
        if self._critic is not None:
            self._critic.optimizer.load_state_dict(broadcast_object(state.get("critic")))


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard `model` with FSDP2, each decoder layer a unit of its own, and return the root unit: a
    `ForwardRunner` holding the rest (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(causal_lm(model)):
        fully_shard(layer, mesh=mesh)
    # The root is resharded after forward too (FSDP2 keeps a root gathered by default): the
    # no-grad scoring passes would otherwise leave gathered copies that an optimizer step
    # then makes stale. Backward gathers it again.
    return fully_shard(ForwardRunner(model), mesh=mesh, reshard_after_forward=True)
