"""Advantage estimators, registered by name: `compute_advantages` dispatches through
`ADV_ESTIMATORS`, so the trainer's call never depends on which estimator is configured.

Pure torch: `(batch, response_len)` token rewards (a sample's scalar reward on its last real
token, a KL penalty possibly folded in) and response mask in, `(advantages, returns)` out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from contracts.training import AdvantageEstimator
from trainer_core.algos.stats import masked_whiten

# Every estimator takes the same keywords, (token_rewards, response_mask, group_ids, values,
# gamma, lam), and ignores those it does not use, so the trainer's call never depends on which
# estimator is configured. Each returns (advantages, returns), both (batch, response_len).
AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


def grpo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    eps: float = 1e-6,
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (Shao et al. 2024, DeepSeekMath): each sample's total reward,
    minus its group's mean, over the group's unbiased std + eps, spread over its tokens.

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels.
    A group of one has no baseline, so its advantage is 0.
    """
    scores = (token_rewards * response_mask).sum(dim=-1)  # (batch,)
    labels = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    index = torch.tensor([labels[g] for g in group_ids], device=scores.device)  # (batch,)
    n_groups = len(labels)

    count = torch.bincount(index, minlength=n_groups).to(scores.dtype)
    mean = torch.zeros(n_groups, device=scores.device).index_add_(0, index, scores) / count
    centered = scores - mean[index]
    sq_sum = torch.zeros(n_groups, device=scores.device).index_add_(0, index, centered**2)
    std = (sq_sum / (count - 1).clamp_min(1)).sqrt()  # unbiased, as torch.std in the paper/verl

    advantages = centered / (std[index] + eps)  # a singleton's centered score is exactly 0
    advantages = advantages[:, None] * response_mask  # (batch,) -> (batch, response_len)
    return advantages, advantages


def gae_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor,
    gamma: float,
    lam: float,
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), advantages whitened over the batch.

    token_rewards, values, response_mask: `(batch, response_len)`.
    Returns are advantages + values, taken before whitening (the critic's regression target).
    Masked positions carry the next real token's value and advantage through unchanged, so
    padding after the last token bootstraps from 0, as at the end of an episode.
    """
    next_value = torch.zeros_like(values[:, 0])  # (batch,)
    next_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(token_rewards.shape[1])):
        mask_t = response_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        next_value = values[:, t] * mask_t + next_value * (1 - mask_t)
        next_advantage = advantage_t * mask_t + next_advantage * (1 - mask_t)
        advantages_reversed.append(advantage_t)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (batch, response_len)
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask) * response_mask, returns


def _group_stats(scores: Tensor, group_ids: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and group size, both `(batch,)`, for `scores` `(batch,)`."""
    labels = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    index = torch.tensor([labels[g] for g in group_ids], device=scores.device)  # (batch,)
    count = torch.bincount(index, minlength=len(labels)).to(scores.dtype)  # (n_groups,)
    sums = torch.zeros(len(labels), dtype=scores.dtype, device=scores.device)
    mean = sums.index_add_(0, index, scores) / count
    return mean[index], count[index]


def _sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Each sample's total reward over its real tokens, `(batch, response_len) -> (batch,)`."""
    return (token_rewards * response_mask).sum(dim=-1)


def dr_grpo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without the
    division by the group std, each sample's total reward minus its group's mean.

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels.
    A group of one is its own mean, so its advantage is 0.
    """
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    group_mean, _ = _group_stats(scores, group_ids)
    advantages = (scores - group_mean)[:, None] * response_mask  # (batch, response_len)
    return advantages, advantages


def rloo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"): each sample's total
    reward minus the mean of the *other* samples of its group, n / (n - 1) * (score - mean).

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels.
    A group of one has no other samples, so its advantage is 0.
    """
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    group_mean, count = _group_stats(scores, group_ids)
    # score - (sum - score) / (n - 1) == n / (n - 1) * (score - mean); a singleton's is 0 * 1.
    scale = count / (count - 1).clamp_min(1)
    advantages = (scale * (scores - group_mean))[:, None] * response_mask
    return advantages, advantages


def _discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """sum_{k >= t} gamma^(k - t) r_k over each sample's real tokens, `(batch, response_len)`;
    0 on padding."""
    running = torch.zeros_like(token_rewards[:, 0])  # (batch,)
    returns_reversed = []
    for t in reversed(range(token_rewards.shape[1])):
        # Masking the running return drops rewards placed on padding (verl does likewise).
        running = (token_rewards[:, t] + gamma * running) * response_mask[:, t]
        returns_reversed.append(running)
    return torch.stack(returns_reversed[::-1], dim=1)  # (batch, response_len)


def reinforce_pp_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): the token-level discounted return, no critic, whitened over every
    real token of the batch (verl `compute_reinforce_plus_plus_outcome_advantage`).

    token_rewards, response_mask: `(batch, response_len)`; a per-token KL penalty, if any, is
    already folded into token_rewards. Returns are the unwhitened discounted returns.
    """
    returns = _discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask, returns


def reinforce_pp_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): each sample's total reward minus its group's mean,
    spread over its tokens, then whitened over every real token of the batch (verl
    `compute_reinforce_plus_plus_baseline_outcome_advantage`).

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels.
    A group of one is centred on itself (0 before whitening), as in `grpo_advantages`; verl
    instead keeps a singleton's raw score.
    """
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    group_mean, _ = _group_stats(scores, group_ids)
    centered = (scores - group_mean)[:, None] * response_mask  # (batch, response_len)
    advantages = masked_whiten(centered, response_mask) * response_mask
    return advantages, advantages


ADV_ESTIMATORS: dict[AdvantageEstimator, AdvantageFn] = {
    AdvantageEstimator.GRPO: grpo_advantages,
    AdvantageEstimator.GAE: gae_advantages,
    AdvantageEstimator.DR_GRPO: dr_grpo_advantages,
    AdvantageEstimator.RLOO: rloo_advantages,
    AdvantageEstimator.REINFORCE_PP: reinforce_pp_advantages,
    AdvantageEstimator.REINFORCE_PP_BASELINE: reinforce_pp_baseline_advantages,
}


def compute_advantages(
    name: str | AdvantageEstimator,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Sequence[Hashable] | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), `(batch, response_len)`, from the estimator registered as `name`."""
    estimator = ADV_ESTIMATORS[AdvantageEstimator(name)]
    return estimator(
        token_rewards,
        response_mask,
        group_ids=group_ids,
        values=values,
        gamma=gamma,
        lam=lam,
    )
