"""One RL update (GRPO or PPO) of a policy on a batch of rollout samples.

Composes the math in `algos`: score the batch and estimate advantages (`rl.batch`), then for
each epoch and (shuffled) mini-batch accumulate micro-batch gradients of the policy loss (- entropy
bonus, + KL-to-reference, + value loss) and take one optimizer step. How gradients become a step
is a `Strategy` (`rl.strategy`): one process, or FSDP2 (`rl.fsdp2`) or DeepSpeed ZeRO
(`rl.zero`) across data-parallel ranks.

An update may checkpoint within itself and resume (`rl.resume`): given an `UpdateCheckpoint`,
it is asked after each optimizer step but the last (there the update ends, and its caller
keeps the result) whether a checkpoint is due, and saves the steps taken, the metric totals and
gradient norms so far, the weights, the optimizer state and the critic's weights; given one
to resume from, it scores the batch with the pre-update model first, as an uninterrupted update
does, then loads the checkpoint and skips the steps already taken (each epoch's order is
seeded), ending as the uninterrupted update would.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from contracts.samples import Sample
from contracts.training import Algorithm, TrainConfig
from trainer_core.algos import (
    AdaptiveKLController,
    FixedKLController,
    PolicyLossParams,
    aggregate_loss,
    aggregation_weight,
    compute_policy_loss,
    kl_penalty,
    value_loss,
)
from trainer_core.logprobs import response_scores
from trainer_core.memory import release_freed_memory
from trainer_core.models.training_mode import training_mode
from trainer_core.rl.batch import BatchTensors, prepare_batch
from trainer_core.rl.batch_metrics import data_metrics
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.micro_batches import micro_batches
from trainer_core.rl.resume import UpdateCheckpoint, UpdateProgress, read_update_state, write_update_state
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
    checkpoint: UpdateCheckpoint | None = None,
) -> dict[str, float]:
    """Update `model` (and, for PPO, `value_head`) on `samples`; returns metrics averaged over
    optimizer steps.

    `model` is a transformers causal LM or a peft LoRA model over one; `optimizer` is a torch
    optimizer (one process) or a `Strategy` (`LocalStrategy`, or data-parallel: `samples` are
    this rank's share, in whole GRPO groups, the same number on every rank). The reference
    policy for `kl_coef` is `ref_model`, or a LoRA model's base weights. `kl_controller` (fixed
    or adaptive), when given, supplies the KL coefficient and is updated with this batch's KL.
    `perf/tokens` counts the batch's prompt and response tokens. With `checkpoint` the update
    resumes from the checkpoint it restores, if any, and checkpoints when it is due (`rl.resume`);
    `perf/seconds` is then this run's part of the update.
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
    batch, is_metrics = prepare_batch(model, samples, response_len, cfg, kl_coef, ref_model, critic, strategy)
    loss_fn = partial(
        _micro_batch_loss, model, response_len=response_len, cfg=cfg, kl_coef=kl_coef, critic=critic, strategy=strategy
    )
    steps = _mini_batches(samples, mini_size, cfg)
    # Only now, with the batch scored by the pre-update model: an interrupted update's progress.
    restored = checkpoint.restore() if checkpoint is not None else None
    progress = (
        UpdateProgress.start(device) if restored is None else read_update_state(restored, strategy, critic, device)
    )
    if progress.steps > len(steps):
        raise ValueError(f"the checkpoint is of step {progress.steps}, this update takes {len(steps)} steps")
    save = partial(write_update_state, progress=progress, strategy=strategy, model=model, critic=critic)
    with training_mode(model, cfg.gradient_checkpointing):
        for step, mini in enumerate(steps[progress.steps :], start=progress.steps + 1):
            progress.grad_norms.append(_mini_batch_step(samples, mini, batch, loss_fn, cfg, strategy, progress.totals))
            progress.steps = step
            # None after the last step: the update ends there, and nothing would load it.
            if checkpoint is not None and step < len(steps) and checkpoint.due(step):
                checkpoint.save(step, save)

    release_freed_memory()  # the activations' holes, before the next generation phase
    metrics = _batch_metrics(progress.totals, progress.grad_norms, samples, strategy, kl_controller, start, device)
    tokens = batch.mask.sum()
    all_tokens = strategy.all_reduce(tokens)
    for key, value in is_metrics.items():  # token means of this rank's share -> of the whole batch
        metrics[f"actor/{key}"] = (strategy.all_reduce(value * tokens) / all_tokens).item()
    metrics.update(data_metrics(batch, samples, cfg, strategy))
    return metrics


# Per-token statistics (masked means inside a loss), averaged over micro-batches by their real
# tokens; the loss terms (entropy too, as verl) are averaged by what `loss_agg` averages over, so they add up to the
# mini-batch's loss.
TOKEN_MEAN_METRICS = frozenset({"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "critic/vf_clipfrac"})


def _mini_batches(samples: Sequence[Sample], mini_size: int, cfg: TrainConfig) -> list[list[int]]:
    """Each optimizer step's mini-batch (indices into `samples`), in the order they are taken:
    epoch by epoch, each epoch's order (`_epoch_order`) cut into mini-batches of `mini_size`."""
    steps = []
    for epoch in range(cfg.epochs):
        order = _epoch_order(samples, mini_size, cfg, epoch)
        steps += [order[mb_start : mb_start + mini_size] for mb_start in range(0, len(samples), mini_size)]
    return steps


def _epoch_order(samples: Sequence[Sample], mini_size: int, cfg: TrainConfig, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the samples: with `shuffle` and more than one
    mini-batch, the groups in a permutation seeded by `cfg.seed + epoch` (verl shuffles its
    mini-batches likewise), each group's samples kept together so that they share their prompt's
    pass in a micro-batch; else 0..n-1 (one mini-batch's gradient does not depend on the order)."""
    if not cfg.shuffle or mini_size >= len(samples):
        return list(range(len(samples)))
    groups: dict[str, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        groups[sample.group_id].append(i)
    members = list(groups.values())
    permutation = torch.randperm(len(members), generator=torch.Generator().manual_seed(cfg.seed + epoch))
    return [i for g in permutation.tolist() for i in members[g]]


def _mini_batch_step(
    samples: Sequence[Sample],
    mini: list[int],
    batch: BatchTensors,
    loss_fn: Callable[[list[Sample], BatchTensors], tuple[Tensor, dict[str, Tensor]]],
    cfg: TrainConfig,
    strategy: Strategy,
    totals: dict[str, Tensor],
) -> Tensor:
    """One optimizer step on the mini-batch `mini` (indices into `samples`): accumulate the
    gradients of its micro-batches' losses (`loss_fn` of a micro-batch's samples and rows), each
    weighted by its share of the whole mini-batch over all ranks, add their weighted metrics to
    `totals`, and step; returns the step's gradient norm."""
    agg = cfg.effective_loss_agg
    mini_mask = batch.mask[torch.tensor(mini, device=batch.mask.device)]
    # What each micro-batch's loss is averaged over (loss_agg), and its real tokens (what the
    # per-token statistics are averaged over), summed over ranks, so that the accumulated
    # gradient is that of the whole mini-batch.
    mini_weight, mini_tokens = strategy.all_reduce(torch.stack([aggregation_weight(mini_mask, agg), mini_mask.sum()]))
    for micro in micro_batches(samples, mini, cfg, strategy):
        rows = batch.rows(micro)
        loss, step_metrics = strategy.forward(partial(loss_fn, [samples[i] for i in micro], rows))
        share = aggregation_weight(rows.mask, agg) / mini_weight
        token_share = rows.mask.sum() / mini_tokens
        release_freed_memory()
        strategy.backward(loss * share * strategy.world_size)
        for key, value in step_metrics.items():
            totals[key] += (token_share if key in TOKEN_MEAN_METRICS else share) * value
    return strategy.step()


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
    # Gathered on one device: DeepSpeed reports its norms on the CPU.
    metrics["actor/grad_norm"] = torch.stack([norm.to(device) for norm in grad_norms]).mean().item()
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
    """Loss of one micro-batch, aggregated over its own tokens or sequences by
    `cfg.effective_loss_agg`, and its detached metrics: the policy loss (`cfg.policy_loss`,
    through the registry), minus `entropy_coef` x the policy's entropy (verl's
    `entropy_coeff`), plus `kl_coef` x KL to the reference, plus `vf_coef` x the value loss."""
    # The entropy is always taken: `actor/entropy` is reported every update (a chunk's extra
    # (tokens x vocab) softmax, as the logits are already there).
    scores = response_scores(model, samples, response_len, cfg, critic, strategy, with_entropy=True)
    agg = cfg.effective_loss_agg
    pg_loss, pg_metrics = compute_policy_loss(
        cfg.policy_loss,
        scores.logprob,
        mu.old_logprob,
        mu.advantages,
        mu.mask,
        PolicyLossParams.of(cfg),
        agg,
        mu.is_weights,
    )
    metrics = {f"actor/{key}": value for key, value in pg_metrics.items()}
    metrics["actor/pg_loss"] = pg_loss.detach()
    entropy = aggregate_loss(scores.entropy, mu.mask, agg)
    metrics["actor/entropy"] = entropy.detach()
    actor_loss = pg_loss - cfg.entropy_coef * entropy if cfg.entropy_coef > 0 else pg_loss
    if mu.ref_logprob is not None:
        kl = kl_penalty(scores.logprob, mu.ref_logprob, cfg.kl_estimator, cfg.kl_clamp)
        kl_ref = aggregate_loss(kl, mu.mask, agg)
        actor_loss = actor_loss + kl_coef * kl_ref
        metrics["actor/kl_ref"] = kl_ref.detach()
    metrics["actor/loss"] = actor_loss.detach()
    if critic is None:
        return actor_loss, metrics

    vf_loss, vf_metrics = value_loss(scores.values, mu.old_values, mu.returns, mu.mask, cfg.value_clip, agg)
    metrics["critic/vf_loss"] = vf_loss.detach()
    metrics["critic/vf_clipfrac"] = vf_metrics["vf_clipfrac"]
    return actor_loss + cfg.vf_coef * vf_loss, metrics
