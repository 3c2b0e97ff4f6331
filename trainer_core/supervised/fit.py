"""The supervised training loop that SFT and reward-model training share: shuffled epochs of
optimizer steps, each over gradient-accumulated micro-batches, with AdamW, gradient clipping and
an optional linear warmup."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

_T = TypeVar("_T")

# micro_loss(micro_batch, batch): the micro-batch's loss weighted by its share of the optimizer
# step's batch (so that the micro-batch losses sum to the step's loss), and detached metrics
# weighted the same way.
MicroLoss = Callable[[Sequence[_T], Sequence[_T]], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class FitSettings:
    """The loop's hyper-parameters (each trainer's config carries them)."""

    learning_rate: float
    epochs: int
    batch_size: int  # items per optimizer step
    micro_batch_size: int  # items per forward/backward
    weight_decay: float
    max_grad_norm: float
    seed: int  # the shuffling of items each epoch
    warmup_steps: int = 0  # optimizer steps of linear learning-rate warmup, then constant


@dataclass
class FitResult:
    steps: int
    last_epoch: list[dict[str, float]]  # each optimizer step's metrics in the last epoch


def fit(
    model: nn.Module,
    items: Sequence[_T],
    micro_loss: MicroLoss[_T],
    settings: FitSettings,
    *,
    prefix: str,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> FitResult:
    """Train `model`'s parameters that require grad on `items`, in place; the model is left in
    eval mode. Each step's metrics are `micro_loss`'s, summed over its micro-batches, with
    `{prefix}/grad_norm` (before clipping) and `{prefix}/lr`; `on_step(step, metrics)` is called
    after every optimizer step (for progress output)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    # The fused kernel does the whole update in one pass (~5x faster on CPU than the default).
    optimizer = torch.optim.AdamW(
        params, lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=device.type in ("cpu", "cuda")
    )
    warmup = settings.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    generator = torch.Generator().manual_seed(settings.seed)
    step, epoch_metrics = 0, []

    model.train()
    try:
        for _ in range(settings.epochs):
            order = torch.randperm(len(items), generator=generator).tolist()
            epoch_metrics = []
            for start in range(0, len(order), settings.batch_size):
                batch = [items[i] for i in order[start : start + settings.batch_size]]
                optimizer.zero_grad(set_to_none=True)
                totals: dict[str, Tensor] = {}
                for mb_start in range(0, len(batch), settings.micro_batch_size):
                    loss, metrics = micro_loss(batch[mb_start : mb_start + settings.micro_batch_size], batch)
                    loss.backward()
                    for key, value in metrics.items():
                        totals[key] = totals.get(key, 0) + value
                grad_norm = nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
                optimizer.step()
                schedule.step()
                step += 1
                # .item() syncs with the device, once per optimizer step.
                step_metrics = {key: value.item() for key, value in totals.items()}
                step_metrics[f"{prefix}/grad_norm"] = grad_norm.item()
                step_metrics[f"{prefix}/lr"] = schedule.get_last_lr()[0]
                epoch_metrics.append(step_metrics)
                if on_step is not None:
                    on_step(step, step_metrics)
    finally:
        model.eval()
    return FitResult(steps=step, last_epoch=epoch_metrics)


def mean_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over `steps`."""
    return {key: sum(m[key] for m in steps) / len(steps) for key in steps[0]}
