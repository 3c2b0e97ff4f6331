"""The RL math: advantage estimators, KL estimators, policy and value losses.

Pure torch functions, tensors in and `(tensor, metrics)` out; the trainer composes them and
always dispatches estimators by name through the registries below.
Shapes: `batch` samples, `response_len` response tokens (right-padded, `mask` 1 on real tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from contracts.training import AdvantageEstimator, KLEstimator, LossAggMode

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


# --- KL estimators ---------------------------------------------------------------------------




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


def _clipped_token_losses(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate max(-A * ratio, -A * clip(ratio)) `(batch, response_len)`,
    with its clip fraction and the approx KL from the old policy (both scalars)."""
    negative_approx_kl = (logprob - old_logprob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = negative_approx_kl.exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), mask)
    return torch.maximum(pg_losses1, pg_losses2), pg_clipfrac, masked_mean(-negative_approx_kl, mask)


def policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg_mode: str | LossAggMode = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), aggregated over `mask` by `agg_mode`, with
    the optional dual clip bounding the loss of negative-advantage tokens by clip_c * |A|
    (Ye et al. 2020).

    All inputs `(batch, response_len)`. Metrics: `pg_clipfrac` (tokens where the clip is
    active), `ppo_kl` (approx KL of the current policy from the old one).
    """
    pg_losses, pg_clipfrac, ppo_kl = _clipped_token_losses(
        logprob, old_logprob, advantages, mask, clip_low, clip_high
    )
    if clip_c is not None:
        pg_losses3 = -advantages * clip_c
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)

    loss = aggregate_loss(pg_losses, mask, agg_mode)
    return loss, {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    agg_mode: str | LossAggMode = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, 0.5 * the `agg_mode` aggregate of max(unclipped, clipped) squared
    error, the prediction clipped to within `clip` of `old_values` (verl `compute_value_loss`).

    All inputs `(batch, response_len)`. Metric `vf_clipfrac`: tokens where the clip is active.
    """
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(vf_losses1, vf_losses2), mask, agg_mode)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


# --- loss aggregation ------------------------------------------------------------------------




# Aggregators of a per-token loss (verl `agg_loss`). Sequences without a real token are left
# out of the sequence means rather than counted as 0, so padding rows do not dilute the loss.
def _agg_token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(loss_mat, mask)


def _agg_seq_mean_token_sum(loss_mat: Tensor, mask: Tensor) -> Tensor:
    seq_losses = (loss_mat * mask).sum(dim=-1)  # (batch,)
    return masked_mean(seq_losses, (mask.sum(dim=-1) > 0).to(loss_mat.dtype))


def _agg_seq_mean_token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # (batch,)
    return masked_mean(seq_losses, (mask.sum(dim=-1) > 0).to(loss_mat.dtype))


LOSS_AGGREGATORS: dict[LossAggMode, Callable[[Tensor, Tensor], Tensor]] = {
    LossAggMode.TOKEN_MEAN: _agg_token_mean,
    LossAggMode.SEQ_MEAN_TOKEN_SUM: _agg_seq_mean_token_sum,
    LossAggMode.SEQ_MEAN_TOKEN_MEAN: _agg_seq_mean_token_mean,
}


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str | LossAggMode) -> Tensor:
    """Scalar loss from a per-token loss `loss_mat` `(batch, response_len)` over `mask`:
    token-mean (every real token weighs the same; DAPO), seq-mean-token-sum (sum over each
    sequence's tokens, mean over sequences), seq-mean-token-mean (mean over each sequence's
    tokens, then over sequences; the original GRPO)."""
    return LOSS_AGGREGATORS[LossAggMode(mode)](loss_mat, mask)


# --- off-policy correction -------------------------------------------------------------------


def truncated_is_weights(
    logprob_behaviour_old: Tensor, logprob_proximal: Tensor, cap: float
) -> Tensor:
    """Truncated importance weights min(pi_proximal / pi_behaviour, cap), detached, for tokens
    sampled by a stale behaviour policy (truncated IS, Espeholt et al. 2018, IMPALA).

    Both inputs `(batch, response_len)`; returns the same shape. No gradient flows through the
    weights: they re-weight samples, they are not part of the objective being differentiated.
    """
    log_ratio = (logprob_proximal - logprob_behaviour_old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp().clamp(max=cap).detach()


def decoupled_policy_loss(
    logprob: Tensor,
    proximal_logprob: Tensor,
    behaviour_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float | None = None,
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"):
    the clipped surrogate of pi against the proximal policy, each token weighted by the
    (optionally capped) behaviour-to-proximal ratio pi_proximal / pi_behaviour.

    All inputs `(batch, response_len)`. With proximal == behaviour this is `policy_loss`.
    Metrics: `pg_clipfrac`, `ppo_kl` (approx KL of pi from the proximal policy),
    `is_weight_mean` (mean behaviour weight), `is_capfrac` (tokens whose weight hit the cap).
    """
    pg_losses, pg_clipfrac, ppo_kl = _clipped_token_losses(
        logprob, proximal_logprob, advantages, mask, clip_low, clip_high
    )

    cap = float("inf") if is_cap is None else is_cap
    is_weights = truncated_is_weights(behaviour_logprob, proximal_logprob, cap)
    raw_log_w = (proximal_logprob - behaviour_logprob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    is_capfrac = masked_mean((raw_log_w.exp() > cap).float(), mask)

    loss = aggregate_loss(is_weights * pg_losses, mask, agg_mode)
    return loss, {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "is_weight_mean": masked_mean(is_weights, mask),
        "is_capfrac": is_capfrac.detach(),
    }


# --- KL controllers --------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op (Ziegler et al. 2019, as verl/TRL)."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences",
    as verl/TRL `AdaptiveKLController`): the proportional error current_kl / target - 1, clipped
    to +-0.2, moves the coefficient by value *= 1 + error * n_steps / horizon, so it grows while
    the KL is above target and shrinks while below.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt `value` to the KL `current_kl` measured over the last `n_steps` samples."""
        # float() of a device tensor is a CPU-GPU sync point: pass a float where it matters.
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# --- entropy ---------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical softmax(logits), `(..., vocab) -> (...)`, as
    logsumexp(z) - sum(softmax(z) * z) of the max-shifted logits z (verl
    `entropy_from_logits`, plus the shift). Logits of -inf (tokens masked out) contribute 0."""
    # Entropy is shift-invariant; shifting by the max first keeps both terms small, else they
    # cancel catastrophically in fp32 for large logits (e.g. 3e4 + log 3 - 3e4).
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    # 0 * -inf is nan; a token of probability 0 adds nothing to the entropy.
    finite = shifted.masked_fill(probs == 0, 0.0)
    return torch.logsumexp(shifted, dim=-1) - (probs * finite).sum(dim=-1)
