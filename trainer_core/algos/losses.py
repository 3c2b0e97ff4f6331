"""Losses of the update beside the policy losses (`policy_losses`): the clipped value loss,
the aggregators of a per-token loss (registered by name) and truncated importance weights
(the entropy of a token's distribution is taken with its log-prob: `trainer_core.vocab_scores`).

Pure torch: `(batch, response_len)` tensors in, `(loss, metrics)` out; no I/O, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from contracts.training import ISLevel, LossAggMode
from trainer_core.algos.stats import MAX_LOG_RATIO, masked_mean


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


def _agg_token_sum(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return (loss_mat * mask).sum()


def _agg_seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor) -> Tensor:
    # Dr. GRPO's 1/G sum_i sum_t with a constant in place of 1/|o_i|: verl's default
    # loss_scale_factor, the padded response length.
    return _agg_seq_mean_token_sum(loss_mat, mask) / mask.shape[-1]


LOSS_AGGREGATORS: dict[LossAggMode, Callable[[Tensor, Tensor], Tensor]] = {
    LossAggMode.TOKEN_MEAN: _agg_token_mean,
    LossAggMode.SEQ_MEAN_TOKEN_SUM: _agg_seq_mean_token_sum,
    LossAggMode.SEQ_MEAN_TOKEN_MEAN: _agg_seq_mean_token_mean,
    LossAggMode.TOKEN_SUM: _agg_token_sum,
    LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM: _agg_seq_mean_token_sum_norm,
}


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str | LossAggMode) -> Tensor:
    """Scalar loss from a per-token loss `loss_mat` `(batch, response_len)` over `mask`:
    token-mean (every real token weighs the same; DAPO), seq-mean-token-sum (sum over each
    sequence's tokens, mean over sequences), seq-mean-token-mean (mean over each sequence's
    tokens, then over sequences; the original GRPO), token-sum (sum over every real token),
    seq-mean-token-sum-norm (seq-mean-token-sum over the padded response length, a constant;
    Dr. GRPO, verl 0.9.1)."""
    return LOSS_AGGREGATORS[LossAggMode(mode)](loss_mat, mask)


def aggregation_weight(mask: Tensor, mode: str | LossAggMode) -> Tensor:
    """What a loss over `mask` `(batch, response_len)` averages over, so that micro-batch losses
    weighted by weight / (the mini-batch's weight) add up to the mini-batch's loss: its real
    tokens (token-mean), its non-empty sequences (sequence means), 1 (token-sum: the
    mini-batch's loss is the sum of its micro-batches')."""
    mode = LossAggMode(mode)
    if mode == LossAggMode.TOKEN_MEAN:
        return mask.sum()
    if mode == LossAggMode.TOKEN_SUM:
        return torch.ones((), dtype=mask.dtype, device=mask.device)
    return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)


# --- off-policy correction -------------------------------------------------------------------


def truncated_is_weights(
    behaviour_logprob: Tensor,
    proximal_logprob: Tensor,
    mask: Tensor,
    cap: float,
    level: str | ISLevel = ISLevel.TOKEN,
    batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights min(pi_proximal / pi_behaviour, cap) for tokens sampled by a
    stale behaviour policy (truncated IS, Espeholt et al. 2018, IMPALA; verl
    `compute_rollout_correction_weights`), detached, 0 on padding, `(batch, response_len)`.

    `level` token: each token's own ratio; sequence: the product of its tokens' ratios on every
    token of the sequence. `batch_normalize` divides by their mean over the batch's tokens
    (token) or sequences (sequence), after truncation, so they average 1. No gradient flows
    through the weights: they re-weight samples, not the objective. Metrics `is_weight_mean`
    (before normalising) and `is_capfrac` (fraction of tokens whose weight hit the cap).
    """
    log_ratio = proximal_logprob - behaviour_logprob
    if ISLevel(level) == ISLevel.SEQUENCE:
        log_ratio = (log_ratio * mask).sum(dim=-1, keepdim=True).expand_as(mask)  # (batch, 1) -> (batch, response_len)
    raw = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() * mask
    weights = raw.clamp(max=cap).detach()
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_capfrac": masked_mean((raw > cap).to(mask.dtype), mask),
    }
    if batch_normalize:
        if ISLevel(level) == ISLevel.SEQUENCE:
            seq_real = (mask.sum(dim=-1) > 0).to(mask.dtype)
            mean = masked_mean(masked_mean(weights, mask, dim=-1), seq_real)
        else:
            mean = masked_mean(weights, mask)
        weights = torch.where(mean > 1e-8, weights / mean, weights)  # no .item(): no device sync
    return weights, metrics
