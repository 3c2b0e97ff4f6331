"""One RL update (GRPO or PPO) of a policy on a batch of rollout samples.

Composes the math in `algos`: score the batch and estimate advantages (`rl.batch`), then for
each epoch and mini-batch accumulate micro-batch gradients of the clipped surrogate (- entropy
bonus, + KL-to-reference, + value loss) and take one optimizer step. How gradients become a step
is a `Strategy` (`rl.strategy`): one process, or FSDP2 (`rl.fsdp2`) or DeepSpeed ZeRO
(`rl.zero`) across data-parallel ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from contracts.samples import Sample
from contracts.training import Algorithm, LossAggMode, OffPolicy, TrainConfig
from trainer_core.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    decoupled_policy_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from trainer_core.logprobs import response_scores
from trainer_core.memory import release_freed_memory
from trainer_core.models.training_mode import training_mode
from trainer_core.rl.batch import BatchTensors, prepare_batch
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.micro_batches import micro_batches
from trainer_core.rl.strategy import LocalStrategy, Strategy


def train_on_batch(
    model: nn.Module,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer | Strategy,
    *,
    ref_model: nn.Module | None = None,
    value_head: ValueHead | None = None,
    kl_controller: FixedKLController | AdaptiveKLController | None = None,
) -> dict[str, float]:
    """Update `model` (and, for PPO, `value_head`) on `samples`; returns metrics averaged over
    optimizer steps.

    `model` is a transformers causal LM or a peft LoRA model over one; `optimizer` is a torch
    optimizer (one process) or a `Strategy` (`LocalStrategy`, or data-parallel: `samples` are
    this rank's share, in whole GRPO groups, the same number on every rank). The reference
    policy for `kl_coef` is `ref_model`, or a LoRA model's base weights. `kl_controller` (fixed
    or adaptive), when given, supplies the KL coefficient and is updated with this batch's KL.
    `perf/tokens` counts the batch's prompt and response tokens.
    """
    critic = value_head if cfg.algorithm is Algorithm.PPO else None
    strategy = _checked_strategy(model, samples, cfg, optimizer, critic)
    kl_coef = kl_controller.value if kl_controller is not None else cfg.kl_coef
    start = time.perf_counter()
    device = next(model.parameters()).device
    response_len = max(len(s.response_ids) for s in samples)
    mini_size = (cfg.mini_batch or len(samples) * strategy.world_size) // strategy.world_size
    if mini_size < 1:
        raise ValueError(f"mini_batch {cfg.mini_batch} is smaller than the {strategy.world_size} ranks")

    model.eval()  # scored as generation sampled: no dropout
    batch = prepare_batch(model, samples, response_len, cfg, kl_coef, ref_model, critic, strategy)
    loss_fn = partial(_micro_batch_loss, model, response_len=response_len, cfg=cfg, kl_coef=kl_coef,
                      critic=critic, strategy=strategy)  # fmt: skip
    with training_mode(model, cfg.gradient_checkpointing):
        totals: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=device))
        grad_norms = []
        for _ in range(cfg.epochs):
            for mb_start in range(0, len(samples), mini_size):
                mini = range(mb_start, min(mb_start + mini_size, len(samples)))
                # What each micro-batch's loss is averaged over: tokens or sequences (loss_agg),
                # summed over ranks, so that the accumulated gradient is that of the whole mini-batch.
                mini_weight = strategy.all_reduce(_weight(batch.mask[mini.start : mini.stop], cfg.loss_agg))
                for micro in micro_batches(samples, mini, cfg, strategy):
                    rows = batch.rows(micro)
                    loss, step_metrics = strategy.forward(partial(loss_fn, [samples[i] for i in micro], rows))
                    share = _weight(rows.mask, cfg.loss_agg) / mini_weight
                    release_freed_memory()
                    strategy.backward(loss * share * strategy.world_size)
                    for key, value in step_metrics.items():
                        totals[key] += share * value
                grad_norms.append(strategy.step())

    release_freed_memory()  # the activations' holes, before the next generation phase
    return _batch_metrics(totals, grad_norms, samples, strategy, kl_controller, start, device)


def _checked_strategy(
    model: nn.Module,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer | Strategy,
    critic: ValueHead | None,
) -> Strategy:
    """`optimizer` as a `Strategy` (a torch optimizer makes a `LocalStrategy`), once the
    arguments of `train_on_batch` are known to make an update."""
    if not samples:
        raise ValueError("train_on_batch needs at least one sample")
    if cfg.micro_batch == 0:
        raise ValueError("micro_batch 0 means auto: set it to auto_micro_batch(model, samples, cfg) first")
    if cfg.algorithm is Algorithm.PPO and critic is None:
        raise ValueError("ppo needs a value_head")
    if isinstance(optimizer, torch.optim.Optimizer):
        return LocalStrategy(model, optimizer, value_head=critic, max_grad_norm=cfg.max_grad_norm)
    return optimizer


def _batch_metrics(
    totals: dict[str, Tensor],
    grad_norms: list[Tensor],
    samples: Sequence[Sample],
    strategy: Strategy,
    kl_controller: FixedKLController | AdaptiveKLController | None,
    start: float,
    device: torch.device,
) -> dict[str, float]:
    """The update's metrics: the micro-batches' `totals` averaged over the optimizer steps and
    summed over ranks, the mean gradient norm, the KL coefficient (adapted here with the
    batch's KL), and the whole batch's reward and throughput."""
    n_steps = len(grad_norms)
    totals = {key: strategy.all_reduce(value) for key, value in totals.items()}
    # .item() is a device sync; done once, here, rather than per micro-batch.
    metrics = {key: value.item() / n_steps for key, value in totals.items()}
    metrics["actor/grad_norm"] = torch.stack(grad_norms).mean().item()
    metrics.setdefault("actor/kl_ref", 0.0)
    if kl_controller is not None:
        kl_controller.update(metrics["actor/kl_ref"], len(samples) * strategy.world_size)
        metrics["actor/kl_coef"] = kl_controller.value
    # Over the whole batch, all ranks' shares.
    batch_sums = strategy.all_reduce(
        torch.tensor(
            [sum(s.reward for s in samples), sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)],
            dtype=torch.float64,
            device=device,
        )
    ).tolist()
    metrics["reward/mean"] = batch_sums[0] / (len(samples) * strategy.world_size)
    metrics["perf/tokens"] = batch_sums[1]
    metrics["perf/seconds"] = time.perf_counter() - start
    metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / metrics["perf/seconds"]
    return metrics


def _weight(mask: Tensor, loss_agg: str) -> Tensor:
    """What a loss over `mask` `(batch, response_len)` averages over: its real tokens for
    token-mean, its sequences for the sequence-mean modes."""
    if loss_agg == LossAggMode.TOKEN_MEAN:
        return mask.sum()
    return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)


def _micro_batch_loss(
    model: nn.Module,
    samples: Sequence[Sample],
    mu: BatchTensors,
    *,
    response_len: int,
    cfg: TrainConfig,
    kl_coef: float,
    critic: ValueHead | None,
    strategy: Strategy | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch, aggregated over its own tokens or sequences by `cfg.loss_agg`,
    and its detached metrics: the clipped surrogate, minus `entropy_coef` x the policy's entropy
    (verl's `entropy_coeff`), plus `kl_coef` x KL to the reference, plus `vf_coef` x the value
    loss."""
    scores = response_scores(model, samples, response_len, cfg, critic, strategy, with_entropy=cfg.entropy_coef > 0)
    clip_high = cfg.clip_ratio_high or cfg.clip_ratio
    if cfg.off_policy == OffPolicy.DECOUPLED:
        pg_loss, pg_metrics = decoupled_policy_loss(
            scores.logprob, mu.old_logprob, mu.behaviour_logprob, mu.advantages, mu.mask,
            cfg.clip_ratio, clip_high, cfg.is_cap, cfg.loss_agg,
        )
    else:
        pg_loss, pg_metrics = policy_loss(
            scores.logprob, mu.old_logprob, mu.advantages, mu.mask,
            cfg.clip_ratio, clip_high, cfg.dual_clip or None, cfg.loss_agg,
        )
    metrics = {f"actor/{key}": value for key, value in pg_metrics.items()}
    metrics["actor/pg_loss"] = pg_loss.detach()
    actor_loss = pg_loss
    if scores.entropy is not None:  # entropy_coef > 0
        entropy = aggregate_loss(scores.entropy, mu.mask, cfg.loss_agg)
        actor_loss = actor_loss - cfg.entropy_coef * entropy
        metrics["actor/entropy"] = entropy.detach()
    if mu.ref_logprob is not None:
        kl_ref = aggregate_loss(kl_penalty(scores.logprob, mu.ref_logprob, cfg.kl_estimator), mu.mask, cfg.loss_agg)
        actor_loss = actor_loss + kl_coef * kl_ref
        metrics["actor/kl_ref"] = kl_ref.detach()
    metrics["actor/loss"] = actor_loss.detach()
    if critic is None:
        return actor_loss, metrics

    vf_loss, vf_metrics = value_loss(scores.values, mu.old_values, mu.returns, mu.mask, cfg.value_clip, cfg.loss_agg)
    metrics["critic/vf_loss"] = vf_loss.detach()
    metrics["critic/vf_clipfrac"] = vf_metrics["vf_clipfrac"]
    return actor_loss + cfg.vf_coef * vf_loss, metrics
