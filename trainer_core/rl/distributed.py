"""Data-parallel `Strategy`s for `train_on_batch`: torch FSDP2 and DeepSpeed ZeRO.

Every rank runs `train_on_batch` on its own share of the batch (`shard_samples`: whole GRPO
groups, as many samples on each rank), with the strategy built over the same policy weights on
every rank. The strategy averages gradients over ranks; `train_on_batch` has already weighted
each rank's loss so that the average is the gradient of the whole batch's loss, as one process
would compute it.

Launch one process per device with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; `init_distributed` joins the process group they describe (gloo on
CPU, NCCL on GPU):

    torchrun --nproc_per_node=2 train.py

    env = init_distributed()
    strategy = FSDP2Strategy(policy.model, cfg, value_head=value_head)
    metrics = train_on_batch(policy.model, shard_samples(batch, env.rank, env.world_size), cfg,
                             strategy, value_head=value_head)

`train_on_batch` calls the policy's inner model and its LM head itself, rather than the causal
LM's own forward, so each strategy wraps the policy in a `_ForwardRunner` root module whose
forward runs whatever pass `train_on_batch` hands to `Strategy.forward`: FSDP2 gathers the
parameters of its root (embeddings, final norm, LM head, tied or not) in the root's forward,
and DeepSpeed's engine does its per-micro-batch bookkeeping in its own. Collectives happen inside
those passes (FSDP2 per unit, ZeRO-3 per module call), so every rank must make the same calls:
`train_on_batch` gives every rank as many micro-batches and LM-head chunks as the busiest one.

A PPO value head (`Linear(hidden, 1)`) is replicated on every rank by both strategies: its
gradients are averaged with one all-reduce, clipped apart from the actor's (as `LocalStrategy`
does), and stepped by a torch AdamW.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer_core.models.lora import causal_lm
from trainer_core.memory import decoder_layers
from contracts.samples import Sample
from contracts.training import TrainConfig

_T = TypeVar("_T")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# What `save_optimizer_state` writes into its directory.
_OPTIMIZER_FILE = "optimizer.pt"
_CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"
_DEEPSPEED_TAG = "zero"
# Adam's defaults, shared by every optimizer here so that the strategies step as
# `update.build_optimizer` does on one process (no weight decay: see there).
_BETAS, _EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the data-parallel group."""

    rank: int
    world_size: int
    local_rank: int  # index of this process on its machine: which GPU it drives
    device: torch.device


def init_distributed(backend: str | None = None) -> DistEnv:
    """Join the default process group described by torchrun's environment variables.

    The backend is NCCL when CUDA is available (this process then drives GPU LOCAL_RANK), else
    gloo; `backend` overrides it. Joining twice is harmless: an existing group is kept.
    """
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: start this process with torchrun "
            "(python -m torch.distributed.run --nproc_per_node=N ...), or set all of "
            f"{', '.join(_TORCHRUN_VARS)}"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        # MASTER_ADDR and MASTER_PORT are read by the default env:// rendezvous.
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank's process now: close the process group (NCCL then frees its communicators),
    flush logs and stdio, and skip the interpreter's finalization.

    A gloo rank that exits normally can abort ("terminate called without an active exception",
    SIGABRT): a worker thread of the process group drops the last reference to a finished
    collective's tensors while the interpreter is being torn down, and freeing them needs the
    GIL, which a finalizing interpreter refuses by ending the thread (pytorch/pytorch#179291;
    `destroy_process_group` alone does not prevent it while a device mesh still holds the group).
    The 2-rank tests hit it about once in 20 launches; the one caught with a Python stack was
    past the end of the rank's work. Call this once everything the rank writes is durable.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_samples(samples: Sequence[Sample], rank: int, world_size: int) -> list[Sample]:
    """Rank `rank`'s share of `samples`: whole groups (a GRPO baseline is its group's mean, so a
    group must not be split across ranks), consecutive in order of first appearance, and as many
    samples on every rank (each rank then takes the same number of optimizer steps).

    With 4 groups of 2 samples on 2 ranks, rank 0 gets the first two groups and rank 1 the
    last two. Raises ValueError when the groups cannot be shared out evenly that way.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    if len(samples) % world_size:
        raise ValueError(f"{len(samples)} samples do not divide evenly over {world_size} ranks")
    per_rank = len(samples) // world_size
    shares: list[list[Sample]] = [[]]
    for group in groups.values():
        if len(shares[-1]) == per_rank:
            shares.append([])
        shares[-1].extend(group)
        if len(shares[-1]) > per_rank:
            raise ValueError(
                f"groups of sizes {[len(g) for g in groups.values()]} cannot be shared out "
                f"{per_rank} samples per rank without splitting a group"
            )
    return shares[rank]


class _ForwardRunner(nn.Module):
    """Root module around the policy whose forward is a callable: `train_on_batch`'s forward
    passes call the policy's submodules directly, and run inside this module's forward so the
    wrapping (FSDP2's root hooks, DeepSpeed's engine) sees each of them."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn: Callable[[], _T]) -> _T:
        return fn()


def all_reduce(value: Tensor, op: str, device: torch.device) -> Tensor:
    """`value` reduced over the ranks with "sum", "max" or "min" (a new tensor)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    # The tensor travels on the backend's device (NCCL reduces GPU tensors only) and comes back
    # on its own; `copy=True` keeps the caller's tensor untouched.
    reduced = value.detach().to(device, copy=True)
    dist.all_reduce(reduced, op=ops[op])
    return reduced.to(value.device)


class _ReplicatedCritic:
    """A small critic (the PPO value head) kept whole on every rank: gradients averaged with one
    all-reduce, clipped on their own, stepped by a torch AdamW."""

    def __init__(self, critic: nn.Module, lr: float, max_grad_norm: float) -> None:
        self._params = list(critic.parameters())
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in self._params:
                dist.broadcast(p.data, src=0)
        self._max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=0.0)

    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all of them
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(self._params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = g.view_as(p)
        nn.utils.clip_grad_norm_(self._params, self._max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


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
            self._actor, lr=cfg.learning_rate, betas=_BETAS, eps=_EPS, weight_decay=0.0
        )
        self._max_grad_norm = cfg.max_grad_norm
        self._critic = (
            _ReplicatedCritic(value_head, cfg.learning_rate, cfg.max_grad_norm) if value_head is not None else None
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
            torch.save(state, directory / _OPTIMIZER_FILE)

    def load_optimizer_state(self, directory: Path) -> None:
        """Load what `save_optimizer_state` wrote (a collective; only rank 0 reads the file, and
        each rank takes its shards of the state)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = torch.load(directory / _OPTIMIZER_FILE, weights_only=True) if self.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state.get("actor", {}), options=options)
        if self._critic is not None:
            self._critic.optimizer.load_state_dict(broadcast_object(state.get("critic")))


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard `model` with FSDP2, each decoder layer a unit of its own, and return the root unit: a
    `_ForwardRunner` holding the rest (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(causal_lm(model)):
        fully_shard(layer, mesh=mesh)
    # The root is resharded after forward too (FSDP2 keeps a root gathered by default): the
    # no-grad scoring passes would otherwise leave gathered copies that an optimizer step
    # then makes stale. Backward gathers it again.
    return fully_shard(_ForwardRunner(model), mesh=mesh, reshard_after_forward=True)


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError("DeepSpeedStrategy needs DeepSpeed: pip install 'spotrl[deepspeed]'") from error
    return deepspeed


def deepspeed_config(cfg: TrainConfig, zero_stage: int, offload_optimizer: bool) -> dict[str, Any]:
    """The DeepSpeed config of a `DeepSpeedStrategy`: fp32 ZeRO, AdamW, clipping at
    `cfg.max_grad_norm`, and the accumulation boundary left to the caller."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    return {
        # DeepSpeed insists on batch sizes, but they are bookkeeping here: train_on_batch plans
        # its own micro-batches (a varying number per mini-batch) and weights each loss itself.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Every engine.step() is the end of an accumulation window, however many backward
        # passes came before it; no loss is divided by gradient_accumulation_steps.
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.max_grad_norm,
        # With the optimizer offloaded DeepSpeed builds DeepSpeedCPUAdam from this entry,
        # otherwise its fused Adam (adam_w_mode for AdamW).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.learning_rate, "betas": list(_BETAS), "eps": _EPS, "weight_decay": 0.0},
        },
        "zero_optimization": {
            "stage": zero_stage,
            "offload_optimizer": {"device": "cpu" if offload_optimizer else "none"},
            # Overlapping reductions with backward takes device streams (none on CPU), and
            # unmanaged accumulation refuses it at stage 1; on GPUs at stage 2/3 it can be
            # turned on through DeepSpeedStrategy's config_overrides.
            "overlap_comm": False,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, nested dicts key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class DeepSpeedStrategy:
    """DeepSpeed ZeRO (stage 1: optimizer state sharded; 2: gradients too; 3: parameters too),
    fp32, with optional optimizer offload to the CPU (DeepSpeedCPUAdam, a C++ op JIT-built on
    first use into TORCH_EXTENSIONS_DIR).

    The engine's config is `deepspeed_config(cfg, zero_stage, offload_optimizer)` with
    `config_overrides` merged in (nested dicts key by key). The engine wraps a `_ForwardRunner`,
    so every forward pass of `train_on_batch` runs as the engine's forward: ZeRO counts its
    micro-steps there (and ZeRO-3 gathers parameters module by module within it). Needs a process
    group (`init_distributed`) and `pip install 'spotrl[deepspeed]'`.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        zero_stage: int = 2,
        offload_optimizer: bool = False,
        value_head: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        deepspeed = _import_deepspeed()
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedStrategy needs a process group: call init_distributed() first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = model
        self.zero_stage = zero_stage
        runner = _ForwardRunner(model)
        config = _merged(deepspeed_config(cfg, zero_stage, offload_optimizer), config_overrides or {})
        self.engine, *_ = deepspeed.initialize(
            model=runner, model_parameters=[p for p in runner.parameters() if p.requires_grad], config=config
        )
        self.device = self.engine.device
        # Under ZeRO-3 a separate reference model (the KL term's) is partitioned too, in an
        # engine of its own without an optimizer (as DeepSpeed-Chat runs its reference); the same
        # `train_on_batch(ref_model=...)` must be passed. Stages 1-2 keep whole weights anyway.
        self._ref_engine = None
        if ref_model is not None and zero_stage == 3:
            ref_config = {key: value for key, value in config.items() if key not in ("optimizer", "gradient_clipping")}
            ref_config["zero_optimization"] = {
                key: value for key, value in config["zero_optimization"].items() if key != "offload_optimizer"
            }
            self._ref_engine, *_ = deepspeed.initialize(model=_ForwardRunner(ref_model), config=ref_config)
        self._critic = (
            _ReplicatedCritic(value_head, cfg.learning_rate, cfg.max_grad_norm) if value_head is not None else None
        )

    def forward(self, fn: Callable[[], _T]) -> _T:
        return self.engine(fn)

    def reference_forward(self, fn: Callable[[], _T]) -> _T:
        # Without a partitioned reference model the reference is whole on each rank, or is the
        # policy itself (LoRA, adapter off).
        return (self._ref_engine or self.engine)(fn)

    def all_reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        return all_reduce(value, op, self.device)

    def backward(self, loss: Tensor) -> None:
        # train_on_batch has weighted the loss already: no division by accumulation steps.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> Tensor:
        self.engine.step()
        if self._critic is not None:
            self._critic.step()
        # The norm of all ranks' averaged gradients before clipping, as DeepSpeed computed it
        # (None where a config turns its computation off).
        norm = self.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def save_optimizer_state(self, directory: Path) -> None:
        """Write DeepSpeed's checkpoint (each rank its optimizer partition) under `directory`
        (a collective: call it on every rank). It loads at the same process count."""
        self.engine.save_checkpoint(str(directory), tag=_DEEPSPEED_TAG)
        if self._critic is not None and self.rank == 0:
            torch.save(self._critic.optimizer.state_dict(), directory / _CRITIC_OPTIMIZER_FILE)

    def load_optimizer_state(self, directory: Path) -> None:
        """Load what `save_optimizer_state` wrote (a collective; every rank reads its partition)."""
        self.engine.load_checkpoint(
            str(directory), tag=_DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if self._critic is not None:
            self._critic.optimizer.load_state_dict(torch.load(directory / _CRITIC_OPTIMIZER_FILE, weights_only=True))

    def full_state_dict(self) -> dict[str, Tensor]:
        """The policy's whole parameters by name (a collective: call it on every rank)."""
        params = dict(self.model.named_parameters())
        # ZeRO-3 partitions the parameters themselves: gather them for the copy.
        gathered = (
            _import_deepspeed().zero.GatheredParameters(list(params.values())) if self.zero_stage == 3 else nullcontext()
        )
        with gathered:
            return {name: p.detach().clone() for name, p in params.items()}


STRATEGIES = ("fsdp2", "zero1", "zero2", "zero3")


def build_strategy(
    name: str,
    model: nn.Module,
    cfg: TrainConfig,
    *,
    value_head: nn.Module | None = None,
    ref_model: nn.Module | None = None,
    offload_optimizer: bool = False,
) -> FSDP2Strategy | DeepSpeedStrategy:
    """The data-parallel strategy called `name` (one of `STRATEGIES`) over `model`, already on
    this rank's device. FSDP2 and ZeRO-3 shard `ref_model` too.
    `offload_optimizer` keeps ZeRO's optimizer state and step on the CPU."""
    if name == "fsdp2":
        if offload_optimizer:
            raise ValueError("offload_optimizer is a ZeRO option: use strategy zero1, zero2 or zero3")
        return FSDP2Strategy(model, cfg, value_head=value_head, ref_model=ref_model)
    if name in STRATEGIES:
        return DeepSpeedStrategy(
            model, cfg, zero_stage=int(name[-1]), offload_optimizer=offload_optimizer, value_head=value_head,
            ref_model=ref_model,
        )
    raise ValueError(f"unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}")


def broadcast_object(obj: _T | None) -> _T:
    """Rank 0's `obj` on every rank (pickled; what other ranks pass is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
