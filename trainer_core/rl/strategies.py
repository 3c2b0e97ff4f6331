"""Building a data-parallel `Strategy` by name: `FSDP2Strategy` (`rl.fsdp2`) or
`DeepSpeedStrategy` at ZeRO stage 1, 2 or 3 (`rl.zero`); see `rl.distributed` for how the ranks
share the batch."""

from __future__ import annotations

from torch import nn

from contracts.training import TrainConfig
from trainer_core.rl.fsdp2 import FSDP2Strategy
from trainer_core.rl.zero import DeepSpeedStrategy

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
            model,
            cfg,
            zero_stage=int(name[-1]),
            offload_optimizer=offload_optimizer,
            value_head=value_head,
            ref_model=ref_model,
        )
    raise ValueError(f"unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}")
