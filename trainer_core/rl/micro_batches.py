"""How an update splits a mini-batch into micro-batches (fixed-size runs or token budgets, as
many on every rank), and how big a micro-batch is when the config says 0 (auto): the rule of
thumb from free memory, probed on a GPU by trial forward and backward passes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.logprobs import response_scores
from trainer_core.memory import available_memory_gb, plan_micro_batch, plan_micro_batches, probe_micro_batch
from trainer_core.models.training_mode import training_mode
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.strategy import Strategy

log = logging.getLogger(__name__)


def micro_batches(
    samples: Sequence[Sample], rows: Sequence[int], cfg: TrainConfig, strategy: Strategy | None
) -> list[list[int]]:
    """Sample indices of each micro-batch of the mini-batch `rows` (sample indices, in order):
    fixed-size runs, or token-budget batches of similar lengths; every rank makes as many as the
    rank that needs the most."""
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in rows]
    plan = lambda min_count: plan_micro_batches(  # noqa: E731
        lengths, max_samples=cfg.micro_batch, max_tokens=cfg.micro_batch_tokens, min_count=min_count
    )
    batches = plan(1)
    if strategy is not None and strategy.world_size > 1:
        most = int(strategy.all_reduce(torch.tensor(float(len(batches))), op="max"))
        batches = plan(most)
    return [[rows[i] for i in batch] for batch in batches]


def auto_micro_batch(
    model: nn.Module, samples: Sequence[Sample], cfg: TrainConfig, *, value_head: ValueHead | None = None
) -> int:
    """A micro-batch size for updating `model` on batches like `samples`: the rule of thumb
    (`memory.plan_micro_batch`) from the device's free memory (available RAM on a CPU), at most
    the batch; on a GPU then the largest of that, half of it, ... whose forward and backward pass
    over the longest samples runs without running out of memory (the gradients are dropped)."""
    device = next(model.parameters()).device
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    start = min(len(samples), plan_micro_batch(device_memory_gb=available_memory_gb(device), params_billions=billions))
    if device.type != "cuda":
        return start
    longest = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True)
    return probe_micro_batch(lambda size: _trial_pass(model, longest[:size], cfg, value_head), start)


def with_auto_micro_batch(
    cfg: TrainConfig,
    model: nn.Module,
    samples: Sequence[Sample],
    *,
    value_head: ValueHead | None = None,
    agree: Callable[[int], int] = lambda size: size,
) -> TrainConfig:
    """`cfg` as it is, or, when its micro_batch is 0 (auto), with `auto_micro_batch`'s size
    for `samples`, passed through `agree` (data-parallel ranks take the least of theirs)."""
    if cfg.micro_batch:
        return cfg
    size = agree(auto_micro_batch(model, samples, cfg, value_head=value_head))
    log.info("micro-batches of %d samples (micro_batch 0: planned from free memory)", size)
    return cfg.model_copy(update={"micro_batch": size})


def _trial_pass(model: nn.Module, samples: Sequence[Sample], cfg: TrainConfig, value_head: ValueHead | None) -> None:
    """A forward and backward pass over `samples` as an update makes them (the entropy's work
    included); the gradients are dropped and no weight changes."""
    try:
        with training_mode(model, cfg.gradient_checkpointing):
            logprob, values, entropy = response_scores(
                model,
                samples,
                max(len(s.response_ids) for s in samples),
                cfg,
                value_head,
                with_entropy=True,  # as every update takes it (`actor/entropy`)
            )
            loss = logprob.sum() + (values.sum() if values is not None else 0)
            (loss + (entropy.sum() if entropy is not None else 0)).backward()
    finally:
        model.zero_grad(set_to_none=True)
        if value_head is not None:
            value_head.zero_grad(set_to_none=True)
