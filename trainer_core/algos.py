"""The RL math: advantage estimators, KL estimators, policy and value losses.

Pure torch functions, tensors in and `(tensor, metrics)` out; the trainer composes them and
always dispatches estimators by name through the registries below.
Shapes: `batch` samples, `response_len` response tokens (right-padded, `mask` 1 on real tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from enum import StrEnum

import torch
from torch import Tensor

# Log-ratios are clamped before exp(): a stale or badly-off sample must not overflow to inf
# and poison the whole batch (verl clamps likewise).
_MAX_LOG_RATIO = 20.0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 where the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """`x` shifted and scaled to zero mean, unit (unbiased) variance over the masked positions."""
    mean = masked_mean(x, mask)
    centered = x - mean
    count = mask.sum()
    var = masked_mean(centered**2, mask) * count / (count - 1).clamp_min(1)
    return centered * torch.rsqrt(var + eps)


# --- advantage estimators --------------------------------------------------------------------


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"
    GAE = "gae"


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


ADV_ESTIMATORS: dict[AdvantageEstimator, AdvantageFn] = {
    AdvantageEstimator.GRPO: grpo_advantages,
    AdvantageEstimator.GAE: gae_advantages,
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


# --- KL estimators ---------------------------------------------------------------------------


class KLEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


# Estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi
# (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).
def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _kl_k3(log_ratio: Tensor) -> Tensor:
    ref_log_ratio = (-log_ratio).clamp(max=_MAX_LOG_RATIO)
    return ref_log_ratio.exp() - ref_log_ratio - 1


KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.K1: _kl_k1,
    KLEstimator.K2: _kl_k2,
    KLEstimator.K3: _kl_k3,
}


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str | KLEstimator) -> Tensor:
    """Per-token KL estimate, `(batch, response_len)`, with r = logp_ref - logp:
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1 (unbiased, and never negative)."""
    return KL_ESTIMATORS[KLEstimator(kind)](logprob - ref_logprob)


# --- losses ----------------------------------------------------------------------------------


def policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), token-mean over `mask`, with the optional
    dual clip bounding the loss of negative-advantage tokens by clip_c * |A| (Ye et al. 2020).

    All inputs `(batch, response_len)`. Metrics: `pg_clipfrac` (tokens where the clip is
    active), `ppo_kl` (approx KL of the current policy from the old one).
    """
    negative_approx_kl = (logprob - old_logprob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = negative_approx_kl.exp()
    ppo_kl = masked_mean(-negative_approx_kl, mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), mask)
    if clip_c is not None:
        pg_losses3 = -advantages * clip_c
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)

    loss = masked_mean(pg_losses, mask)
    return loss, {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, 0.5 * token-mean of max(unclipped, clipped) squared error, the
    prediction clipped to within `clip` of `old_values` (verl `compute_value_loss`).

    All inputs `(batch, response_len)`. Metric `vf_clipfrac`: tokens where the clip is active.
    """
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(vf_losses1, vf_losses2), mask)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}
