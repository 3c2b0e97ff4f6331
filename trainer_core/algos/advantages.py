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
# reward_baselines, gamma, lam), and ignores those it does not use, so the trainer's call never depends on which
# estimator is configured. Each returns (advantages, returns), both (batch, response_len).
AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


def _group_index(group_ids: Sequence[Hashable], device: torch.device) -> tuple[Tensor, int]:
    """Each sample's group as 0..n_groups-1 in order of first appearance `(batch,)`, and n_groups."""
    labels = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    return torch.tensor([labels[g] for g in group_ids], device=device), len(labels)


def _group_stats(scores: Tensor, group_ids: Sequence[Hashable]) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and group size, both `(batch,)`, for `scores` `(batch,)`."""
    index, n_groups = _group_index(group_ids, scores.device)
    count = torch.bincount(index, minlength=n_groups).to(scores.dtype)  # (n_groups,)
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    mean = sums.index_add_(0, index, scores) / count
    return mean[index], count[index]


def _sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Each sample's total reward over its real tokens, `(batch, response_len) -> (batch,)`."""
    return (token_rewards * response_mask).sum(dim=-1)


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
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    group_mean, count = _group_stats(scores, group_ids)
    centered = scores - group_mean
    sq_mean, _ = _group_stats(centered**2, group_ids)
    std = (sq_mean * count / (count - 1).clamp_min(1)).sqrt()  # unbiased, as torch.std in the paper/verl

    advantages = centered / (std + eps)  # a singleton's centered score is exactly 0
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
    """sum over the real tokens k >= t of gamma^(steps from t to k) r_k, `(batch, response_len)`;
    0 off the mask. Masked positions inside a response (a multi-turn tool observation) are not
    steps: the return carries across them undiscounted, and rewards on them are dropped (verl
    PR #7300, "carry running_return through observation spans")."""
    running = torch.zeros_like(token_rewards[:, 0])  # (batch,)
    returns_reversed = []
    for t in reversed(range(token_rewards.shape[1])):
        real = response_mask[:, t] > 0
        running = torch.where(real, token_rewards[:, t] + gamma * running, running)
        returns_reversed.append(running * response_mask[:, t])
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


def remax_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_baselines: Tensor,
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505), verl `compute_remax_outcome_advantage`: each
    token's return-to-go minus the reward of the prompt's greedy response.

    token_rewards, response_mask: `(batch, response_len)`; reward_baselines: `(batch,)`, each
    sample's greedy-response reward. Returns are the undiscounted returns-to-go.
    """
    returns = (token_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines[:, None] * response_mask
    return advantages, returns


def opo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """OPO, on-policy RL with the optimal reward baseline (Hao et al. 2025, arXiv 2505.23585),
    verl `compute_opo_outcome_advantage`: each sample's total reward minus its group's mean
    reward weighted by response length, sum(|y| r) / sum(|y|).

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels.
    A group of one has baseline 0 (its advantage is its reward), as verl.
    """
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    weighted_mean, count = _group_stats(lengths * scores, group_ids)
    length_mean, _ = _group_stats(lengths, group_ids)
    baseline = torch.where(count > 1, weighted_mean / length_mean, torch.zeros_like(scores))
    advantages = (scores - baseline)[:, None] * response_mask
    return advantages, advantages


def grpo_passk_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Sequence[Hashable],
    eps: float = 1e-6,
    **_unused: object,
) -> tuple[Tensor, Tensor]:
    """GRPO pass@k (Chen et al. 2025, arXiv 2503.19595), verl
    `compute_grpo_passk_outcome_advantage`: only each group's best sample (the first of equal
    best) gets an advantage, (r_max - r_second_max) / (the group's unbiased std + eps); the
    rest get 0.

    token_rewards, response_mask: `(batch, response_len)`; group_ids: `batch` labels, every
    group at least 2 samples.
    """
    scores = _sequence_scores(token_rewards, response_mask)  # (batch,)
    index, n_groups = _group_index(group_ids, scores.device)
    group_mean, count = _group_stats(scores, group_ids)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group: set the run's samples_per_prompt >= 2")
    per_group = lambda values, reduce, fill: torch.full(  # noqa: E731
        (n_groups,), fill, dtype=scores.dtype, device=scores.device
    ).scatter_reduce(0, index, values, reduce=reduce)
    group_max = per_group(scores, "amax", -torch.inf)[index]
    positions = torch.arange(len(scores), device=scores.device, dtype=scores.dtype)
    first_best = per_group(torch.where(scores == group_max, positions, torch.inf), "amin", torch.inf)[index]
    is_best = positions == first_best  # (batch,)
    second_max = per_group(scores.masked_fill(is_best, -torch.inf), "amax", -torch.inf)[index]
    sq_mean, _ = _group_stats((scores - group_mean) ** 2, group_ids)
    std = (sq_mean * count / (count - 1)).sqrt()
    advantages = torch.where(is_best, (group_max - second_max) / (std + eps), torch.zeros_like(scores))
    advantages = advantages[:, None] * response_mask  # (batch,) -> (batch, response_len)
    return advantages, advantages


ADV_ESTIMATORS: dict[AdvantageEstimator, AdvantageFn] = {
    AdvantageEstimator.GRPO: grpo_advantages,
    AdvantageEstimator.GAE: gae_advantages,
    AdvantageEstimator.DR_GRPO: dr_grpo_advantages,
    AdvantageEstimator.RLOO: rloo_advantages,
    AdvantageEstimator.REINFORCE_PP: reinforce_pp_advantages,
    AdvantageEstimator.REINFORCE_PP_BASELINE: reinforce_pp_baseline_advantages,
    AdvantageEstimator.REMAX: remax_advantages,
    AdvantageEstimator.OPO: opo_advantages,
    AdvantageEstimator.GRPO_PASSK: grpo_passk_advantages,
}


def compute_advantages(
    name: str | AdvantageEstimator,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Sequence[Hashable] | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), `(batch, response_len)`, from the estimator registered as `name`;
    `reward_baselines` `(batch,)` is ReMax's greedy-response rewards."""
    estimator = ADV_ESTIMATORS[AdvantageEstimator(name)]
    return estimator(
        token_rewards,
        response_mask,
        group_ids=group_ids,
        values=values,
        reward_baselines=reward_baselines,
        gamma=gamma,
        lam=lam,
    )
