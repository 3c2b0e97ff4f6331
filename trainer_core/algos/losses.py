"""Losses of the update: the PPO clipped surrogate (with dual clip), decoupled PPO with
truncated importance weights, the clipped value loss, the aggregators of a per-token loss
(registered by name), and the entropy of a token distribution.

Pure torch: `(batch, response_len)` tensors in, `(loss, metrics)` out; no I/O, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from contracts.training import LossAggMode
from trainer_core.algos.stats import MAX_LOG_RATIO, masked_mean


def _clipped_token_losses(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate max(-A * ratio, -A * clip(ratio)) `(batch, response_len)`,
    with its clip fraction and the approx KL from the old policy (both scalars)."""
    negative_approx_kl = (logprob - old_logprob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
    log_ratio = (logprob_proximal - logprob_behaviour_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
    raw_log_w = (proximal_logprob - behaviour_logprob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    is_capfrac = masked_mean((raw_log_w.exp() > cap).float(), mask)

    loss = aggregate_loss(is_weights * pg_losses, mask, agg_mode)
    return loss, {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "is_weight_mean": masked_mean(is_weights, mask),
        "is_capfrac": is_capfrac.detach(),
    }


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
