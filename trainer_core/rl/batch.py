"""The batch's fixed inputs of an update, computed once before its first step: response masks,
behaviour log-probs and token rewards from the samples; reference log-probs (a KL term), the
proximal policy's log-probs (decoupled PPO) and the critic's values (PPO) from no-grad scoring
passes; and the advantages and returns, estimated over the whole batch even across ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import Tensor, nn

from contracts.samples import Sample
from contracts.training import AdvantageEstimator, KLMode, OffPolicy, TrainConfig
from trainer_core.algos import compute_advantages, kl_penalty, truncated_is_weights
from trainer_core.algos.reward_shaping import overlong_penalty
from trainer_core.logprobs import response_scores
from trainer_core.models.lora import reference_policy
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.micro_batches import micro_batches
from trainer_core.rl.strategy import Strategy

_T = TypeVar("_T")


@dataclass
class BatchTensors:
    """Per-token inputs of the losses, each `(batch, response_len)`, fixed for the whole update."""

    mask: Tensor
    old_logprob: Tensor  # what the ratio is clipped around: behaviour or proximal log-probs
    behaviour_logprob: Tensor  # from the samples
    advantages: Tensor
    returns: Tensor
    ref_logprob: Tensor | None  # with a KL loss term
    old_values: Tensor | None  # PPO: the critic's values before the update
    is_weights: Tensor | None  # decoupled PPO: truncated importance weights, detached

    def rows(self, rows: Sequence[int]) -> BatchTensors:
        """The same tensors for some of the samples."""
        index = torch.tensor(rows, device=self.mask.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return BatchTensors(
            mask=pick(self.mask),
            old_logprob=pick(self.old_logprob),
            behaviour_logprob=pick(self.behaviour_logprob),
            advantages=pick(self.advantages),
            returns=pick(self.returns),
            ref_logprob=pick(self.ref_logprob),
            old_values=pick(self.old_values),
            is_weights=pick(self.is_weights),
        )


def prepare_batch(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    kl_coef: float,
    ref_model: nn.Module | None,
    critic: ValueHead | None,
    strategy: Strategy,
) -> tuple[BatchTensors, dict[str, Tensor]]:
    """Score the batch before any step (reference log-probs when `kl_coef` > 0, proximal
    log-probs and the `critic`'s old values when needed), shape rewards of overlong responses
    (`overlong_buffer`), estimate advantages, and (decoupled
    PPO) weigh the tokens by truncated IS, normalised over this rank's batch when asked.
    Returns `(tensors, metrics)`: the IS weights' statistics."""
    device = next(model.parameters()).device
    mask, behaviour_logprob, token_rewards = _response_tensors(samples, response_len, device)
    if cfg.overlong_buffer:
        lengths = mask.sum(dim=-1)  # (batch,); the shaping lands with the reward, on the last token
        shaping = overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        token_rewards = token_rewards.scatter_add(1, (lengths.long() - 1)[:, None], shaping[:, None])
    with torch.no_grad():
        ref_logprob = None
        if kl_coef > 0:
            with reference_policy(model, ref_model) as ref:
                ref_logprob = _score(
                    ref, samples, response_len, cfg, strategy=strategy, forward=strategy.reference_forward
                )
        old_values = proximal = None
        if critic is not None or cfg.off_policy == OffPolicy.DECOUPLED:
            proximal, old_values = _score(
                model, samples, response_len, cfg, critic, with_values=True, strategy=strategy
            )
    if ref_logprob is not None and cfg.kl_mode == KLMode.REWARD:
        kl = kl_penalty(behaviour_logprob, ref_logprob, cfg.kl_estimator, cfg.kl_clamp)
        token_rewards = token_rewards - kl_coef * kl * mask
    advantages, returns = _batch_advantages(
        cfg.advantage_estimator,
        token_rewards,
        mask,
        [s.group_id for s in samples],
        old_values,
        _reward_baselines(samples, cfg, device),
        cfg,
        strategy,
    )
    is_weights, is_metrics = None, {}
    if cfg.off_policy == OffPolicy.DECOUPLED:
        is_weights, is_metrics = truncated_is_weights(
            behaviour_logprob, proximal, mask, cfg.is_cap, cfg.is_level, cfg.is_batch_normalize
        )
    return BatchTensors(
        mask=mask,
        old_logprob=proximal if cfg.off_policy == OffPolicy.DECOUPLED else behaviour_logprob,
        behaviour_logprob=behaviour_logprob,
        advantages=advantages,
        returns=returns,
        ref_logprob=ref_logprob if cfg.kl_mode == KLMode.LOSS else None,
        old_values=old_values,
        is_weights=is_weights,
    ), is_metrics


def _reward_baselines(samples: Sequence[Sample], cfg: TrainConfig, device: torch.device) -> Tensor | None:
    """ReMax's baselines `(batch,)`: each sample's greedy-response reward; None for the others."""
    if cfg.advantage_estimator != AdvantageEstimator.REMAX:
        return None
    missing = [s.sample_id for s in samples if s.baseline_reward is None]
    if missing:
        raise ValueError(
            f"remax needs each sample's baseline_reward (its prompt's greedy response's reward); "
            f"{len(missing)} samples have none, e.g. {missing[0]}. Rollout workers add it when the run's "
            "adv_estimator is remax; colocated runs do not yet: use a disaggregated run or another estimator"
        )
    return torch.tensor([s.baseline_reward for s in samples], dtype=torch.float32, device=device)


def _batch_advantages(
    estimator: str,
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: list[str],
    values: Tensor | None,
    reward_baselines: Tensor | None,
    cfg: TrainConfig,
    strategy: Strategy,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns `(batch, response_len)` of this rank's samples, as one process
    would compute them over the whole batch.

    Some estimators whiten over the batch (GAE, REINFORCE++): on one rank's share alone their
    mean and variance would differ from the batch's. So each rank gathers every rank's rows
    (one all-reduce of a zero-padded `(world_size * batch, max_response_len)` tensor per input),
    estimates on all of them, and keeps its own. Ranks hold whole groups, so a group's index
    in the gathered batch is its rank's row offset plus its index on that rank.
    """
    kwargs = {"gamma": cfg.gamma, "lam": cfg.lam}
    if strategy.world_size == 1:
        return compute_advantages(
            estimator,
            token_rewards=token_rewards,
            response_mask=mask,
            group_ids=group_ids,
            values=values,
            reward_baselines=reward_baselines,
            **kwargs,
        )
    n, length = mask.shape
    # One all-reduce for the longest response and the smallest and largest share (max of -n).
    longest, most, minus_fewest = strategy.all_reduce(
        torch.tensor([float(length), float(n), -float(n)], device=mask.device), op="max"
    ).tolist()
    if most != -minus_fewest:
        raise ValueError(f"every rank must hold as many samples; this one has {n}, another {int(most)}")
    rows = slice(strategy.rank * n, (strategy.rank + 1) * n)

    def gather(x: Tensor) -> Tensor:  # (n, width <= longest) -> (world_size * n, longest), zero-padded
        full = x.new_zeros(strategy.world_size * n, int(longest))
        full[rows, : x.shape[1]] = x
        return strategy.all_reduce(full)

    local_index = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    groups = torch.tensor([[strategy.rank * n + local_index[g]] for g in group_ids], dtype=torch.float32)
    advantages, returns = compute_advantages(
        estimator,
        token_rewards=gather(token_rewards),
        response_mask=gather(mask),
        group_ids=[int(g) for g in gather(groups.to(mask.device))[:, 0].tolist()],
        values=gather(values) if values is not None else None,
        reward_baselines=gather(reward_baselines[:, None])[:, 0] if reward_baselines is not None else None,
        **kwargs,
    )
    return advantages[rows, :length], returns[rows, :length]


def _response_tensors(
    samples: Sequence[Sample], response_len: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded response mask, behaviour log-probs and token rewards (the sample's scalar
    reward on its last token), each `(batch, response_len)`."""
    mask = torch.zeros(len(samples), response_len)
    old_logprob = torch.zeros(len(samples), response_len)
    token_rewards = torch.zeros(len(samples), response_len)
    for row, sample in enumerate(samples):
        n = len(sample.response_ids)
        if not sample.prompt_ids or n == 0 or len(sample.logprobs) != n:
            raise ValueError(
                f"sample {sample.sample_id}: needs a prompt, a response, and one logprob per response token"
            )
        mask[row, :n] = 1.0
        old_logprob[row, :n] = torch.tensor(sample.logprobs)
        token_rewards[row, n - 1] = sample.reward
    return mask.to(device), old_logprob.to(device), token_rewards.to(device)


def _score(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHead | None = None,
    *,
    with_values: bool = False,
    strategy: Strategy | None = None,
    forward: Callable[[Callable[[], _T]], _T] | None = None,
) -> Tensor | tuple[Tensor, Tensor | None]:
    """Log-probs under `model` `(batch, response_len)`, and with `with_values` the value head's
    values too (None without one), computed micro-batch by micro-batch (no grad expected);
    each forward pass runs through `forward`, else `strategy.forward` when given, as many on
    every rank."""
    run = forward or (strategy.forward if strategy is not None else (lambda fn: fn()))
    logprobs = torch.zeros(len(samples), response_len, device=next(model.parameters()).device)
    values = torch.zeros_like(logprobs) if value_head is not None else None
    for micro in micro_batches(samples, range(len(samples)), cfg, strategy):
        micro_samples = [samples[i] for i in micro]
        scores = run(partial(response_scores, model, micro_samples, response_len, cfg, value_head, strategy))
        index = torch.tensor(micro, device=logprobs.device)
        logprobs.index_copy_(0, index, scores.logprob)
        if values is not None:
            values.index_copy_(0, index, scores.values)
    return (logprobs, values) if with_values else logprobs
