"""`DeepSpeedStrategy`: data-parallel `train_on_batch` with DeepSpeed ZeRO stage 1, 2 or 3, and
its DeepSpeed config (`deepspeed_config`); see `rl.distributed` for how the ranks share the
batch. Needs `pip install 'spotrl[deepspeed]'`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.training import TrainConfig
from trainer_core.rl.distributed import ForwardRunner, ReplicatedCritic, all_reduce, broadcast_whole
from trainer_core.rl.strategy import ADAM_BETAS, ADAM_EPS

_T = TypeVar("_T")

_DEEPSPEED_TAG = "zero"
# What `save_optimizer_state` writes next to DeepSpeed's checkpoint: the replicated critic's state.
_CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"


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
            "params": {"lr": cfg.learning_rate, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": 0.0},
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
    `config_overrides` merged in (nested dicts key by key). The engine wraps a `ForwardRunner`,
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
        runner = ForwardRunner(model)
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
            self._ref_engine, *_ = deepspeed.initialize(model=ForwardRunner(ref_model), config=ref_config)
        self._critic = (
            ReplicatedCritic(value_head, cfg.learning_rate, cfg.max_grad_norm) if value_head is not None else None
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

    def load_full_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Copy rank 0's `weights` (whole parameters by name, all or some) into the parameters and
        into ZeRO's fp32 master copies of them, which the optimizer holds partitioned over the
        ranks and writes back over the parameters at each step (a collective: the other ranks may
        pass {}). The masters are set through DeepSpeed's tensor-fragment API
        (`deepspeed.utils.safe_set_full_fp32_param`, ZeRO stages 1-3, offloaded or not)."""
        deepspeed = _import_deepspeed()
        from deepspeed.utils import safe_set_full_fp32_param

        params = dict(self.model.named_parameters())
        # ZeRO-3 holds a partition of each parameter: its whole shape is ds_shape.
        shape_of = (lambda p: p.ds_shape) if self.zero_stage == 3 else (lambda p: p.shape)
        with torch.no_grad():
            for param, whole in broadcast_whole(weights, params, self.rank, self.device, shape_of):
                safe_set_full_fp32_param(param, whole)  # a frozen parameter has no master: nothing done
                # ZeRO-3: gathered whole, set, and partitioned again from rank 0's copy.
                gathered = (
                    deepspeed.zero.GatheredParameters([param], modifier_rank=0)
                    if self.zero_stage == 3
                    else nullcontext()
                )
                with gathered:
                    param.data.copy_(whole)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The policy's whole parameters by name (a collective: call it on every rank)."""
        params = dict(self.model.named_parameters())
        # ZeRO-3 partitions the parameters themselves: gather them for the copy.
        gathered = (
            _import_deepspeed().zero.GatheredParameters(list(params.values()))
            if self.zero_stage == 3
            else nullcontext()
        )
        with gathered:
            return {name: p.detach().clone() for name, p in params.items()}
