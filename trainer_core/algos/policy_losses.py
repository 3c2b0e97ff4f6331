"""Policy losses, registered by name (`POLICY_LOSSES`, `training.policy_loss`), matching verl
`core_algos.py` (`register_policy_loss`) numerically.

Every loss takes the same arguments: `logprob` (the policy being trained, with grad),
`old_logprob` (what the ratio is taken against: behaviour or proximal log-probs), `advantages`
and `mask`, all `(batch, response_len)`; `params` (clip ranges and each loss's own knobs);
`agg_mode` (how token losses become a scalar); and `is_weights`, detached truncated importance
weights `(batch, response_len)` that multiply the token losses (decoupled PPO), or None.
Each returns `(loss, metrics)`; metrics are detached scalars: `pg_clipfrac`,
`pg_clipfrac_lower` (dual clip), `ppo_kl` (approx KL of pi from old).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from contracts.training import LossAggMode, PolicyLoss, TrainConfig
from trainer_core.algos.losses import aggregate_loss
from trainer_core.algos.stats import MAX_LOG_RATIO, masked_mean


@dataclass(frozen=True)
class PolicyLossParams:
    """The knobs of the policy losses (verl `actor.clip_ratio*` and `actor.policy_loss.*`)."""

    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    clip_c: float | None = None  # dual clip bound on negative-advantage losses (None = off)
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance window of the tokens that may be cut
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens given the |log ratio| penalty
    ppo_kl_coef: float = 1.0  # kl_cov: weight of that penalty

    @classmethod
    def of(cls, cfg: TrainConfig) -> PolicyLossParams:
        """The parameters a run's training section sets."""
        return cls(
            clip_low=cfg.clip_ratio,
            clip_high=cfg.clip_ratio_high or cfg.clip_ratio,
            clip_c=cfg.dual_clip or None,
            clip_cov_ratio=cfg.clip_cov_ratio,
            clip_cov_lb=cfg.clip_cov_lb,
            clip_cov_ub=cfg.clip_cov_ub,
            kl_cov_ratio=cfg.kl_cov_ratio,
            ppo_kl_coef=cfg.ppo_kl_coef,
        )


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


def _weighted(pg_losses: Tensor, is_weights: Tensor | None) -> Tensor:
    return pg_losses if is_weights is None else pg_losses * is_weights


def _metrics(pg_clipfrac: Tensor, ppo_kl: Tensor, pg_clipfrac_lower: Tensor) -> dict[str, Tensor]:
    return {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }


def vanilla_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with the optional dual clip (Ye et al. 2020),
    verl `compute_policy_loss_vanilla`: r = exp(clamp(logp - logp_old, +-20)),
    L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), for A < 0 at most -A c."""
    negative_approx_kl = (logprob - old_logprob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = negative_approx_kl.exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(mask.dtype), mask)
    pg_losses, pg_clipfrac_lower = clip_pg_losses1, torch.zeros((), device=mask.device)
    if params.clip_c is not None:
        pg_losses3 = -advantages * params.clip_c
        pg_clipfrac_lower = masked_mean(((clip_pg_losses1 > pg_losses3) & (advantages < 0)).to(mask.dtype), mask)
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses3, clip_pg_losses1), clip_pg_losses1)
    loss = aggregate_loss(_weighted(pg_losses, is_weights), mask, agg_mode)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, mask), pg_clipfrac_lower)


def gspo_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.SEQ_MEAN_TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), verl `compute_policy_loss_gspo`: the
    sequence ratio s_i = exp(mean_t log(pi / pi_old)), clipped PPO-style, each token's ratio
    s_i,t = sg[s_i] pi_t / sg[pi_t] (same value, token gradient), log clamped at 10.
    Aggregated seq-mean-token-mean whatever `agg_mode` says: the paper's sequence-level
    objective (verl 0.9.1 follows `loss_agg_mode` instead)."""
    negative_approx_kl = logprob - old_logprob
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    negative_approx_kl_seq = (negative_approx_kl * mask).sum(dim=-1) / seq_lengths  # (batch,)
    log_seq_ratio = logprob - logprob.detach() + negative_approx_kl_seq.detach()[:, None]
    seq_ratio = log_seq_ratio.clamp(max=10.0).exp()  # (batch, response_len)
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * seq_ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = aggregate_loss(_weighted(pg_losses, is_weights), mask, LossAggMode.SEQ_MEAN_TOKEN_MEAN)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(mask.dtype), mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, mask), torch.zeros((), device=mask.device))


def cispo_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585), verl `compute_policy_loss_cispo`:
    L = -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi: the IS weight is clipped, never the
    gradient, so every token keeps contributing."""
    negative_approx_kl = (logprob - old_logprob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = negative_approx_kl.exp()
    clipped_ratio = ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * logprob
    loss = aggregate_loss(_weighted(pg_losses, is_weights), mask, agg_mode)
    pg_clipfrac = masked_mean((ratio != clipped_ratio).to(mask.dtype), mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, mask), torch.zeros((), device=mask.device))


def _covariance(advantages: Tensor, logprob: Tensor, mask: Tensor) -> Tensor:
    """Per-token (A - mean A)(logp - mean logp), means over the real tokens, `(batch, response_len)`,
    detached (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", eq. 11)."""
    logprob = logprob.detach()
    return (advantages - masked_mean(advantages, mask)) * (logprob - masked_mean(logprob, mask))


def clip_cov_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617), verl `compute_policy_loss_clip_cov`: the PPO
    clipped surrogate, but of the tokens not clipped already whose covariance lies in
    (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * n_tokens)) chosen at random (torch's
    global generator) have their loss, and so their gradient, set to 0. `pg_clipfrac` is the
    fraction cut."""
    negative_approx_kl = logprob - old_logprob
    ratio = negative_approx_kl.exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - params.clip_low, 1 + params.clip_high)
    real = mask > 0
    cov = _covariance(advantages, logprob, mask)
    candidates = real & ~(pg_losses2 > pg_losses1) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    candidate_idx = torch.nonzero(candidates)  # (n_candidates, 2)
    clip_num = max(int(params.clip_cov_ratio * mask.sum().item()), 1)  # .item(): a device sync, as verl
    chosen = candidate_idx[torch.randperm(len(candidate_idx), device=mask.device)[:clip_num]]
    corr = torch.ones_like(advantages)
    corr[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    loss = aggregate_loss(_weighted(pg_losses, is_weights), mask, agg_mode)
    pg_clipfrac = masked_mean((corr == 0).to(mask.dtype), mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, mask), torch.zeros((), device=mask.device))


def kl_cov_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617), verl `compute_policy_loss_kl_cov`: the
    unclipped surrogate -A r, plus ppo_kl_coef * |log r| on the max(1, int(kl_cov_ratio *
    n_tokens)) real tokens of largest covariance. `ppo_kl` is the mean |log r| (as verl)."""
    negative_approx_kl = logprob - old_logprob
    abs_kl = negative_approx_kl.abs()
    pg_losses1 = -advantages * negative_approx_kl.exp()
    cov = _covariance(advantages, logprob, mask).masked_fill(mask == 0, -torch.inf).flatten()
    n_selected = max(1, int(mask.sum().item() * params.kl_cov_ratio))  # .item(): a device sync, as verl
    selected = torch.zeros_like(cov, dtype=torch.bool)
    selected[torch.topk(cov, n_selected).indices] = True
    selected = selected.view_as(mask)  # (batch * response_len,) -> (batch, response_len)
    pg_losses = torch.where(selected, pg_losses1 + params.ppo_kl_coef * abs_kl, pg_losses1)
    loss = aggregate_loss(_weighted(pg_losses, is_weights), mask, agg_mode)
    zero = torch.zeros((), device=mask.device)
    return loss, _metrics(zero, masked_mean(abs_kl, mask), zero)


def gpg_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline", arXiv 2504.02546), verl
    `compute_policy_loss_gpg`: L = -A log pi, no ratio, no clip; `old_logprob` is used only for
    the `ppo_kl` metric."""
    loss = aggregate_loss(_weighted(-logprob * advantages, is_weights), mask, agg_mode)
    zero = torch.zeros((), device=mask.device)
    return loss, _metrics(zero, masked_mean(old_logprob - logprob, mask), zero)


def reinforce_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain REINFORCE (Williams 1992), verl `compute_policy_loss_reinforce`: L = -w A log pi with
    the optional IS weight w, no clipping. The same numbers as `gpg_policy_loss`; kept apart
    because verl names both, and a run spec names what it means."""
    return gpg_policy_loss(logprob, old_logprob, advantages, mask, params, agg_mode, is_weights)


def geo_mean_policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.SEQ_MEAN_TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673), verl
    `compute_policy_loss_geo_mean`: each token's log ratio clipped to [-eps_low, eps_high] on the
    pessimistic side (sign of A), the sequence ratio their mean's exp, L_i = -mean_t(A) r_i,
    the mean over the sequences with a real token (whatever `agg_mode` says, as verl, whose
    mean also counts empty sequences as 0). IS weights enter as their
    per-sequence geometric mean. `pg_clipfrac`/`_lower`: clipped tokens with A > 0 / A < 0."""
    negative_approx_kl = logprob - old_logprob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = negative_approx_kl.clamp(-params.clip_low, params.clip_high)
    negative_approx_kl_min = sgn_advantage * torch.minimum(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    lengths = mask.sum(dim=-1) + 1e-8  # (batch,)
    ratio = ((negative_approx_kl_min * mask).sum(dim=-1) / lengths).exp()  # (batch,)
    advantage = (advantages * mask).sum(dim=-1) / lengths  # sequence-level advantages only, as verl
    pg_losses = -advantage * ratio  # (batch,)
    if is_weights is not None:
        pg_losses = pg_losses * ((torch.log(is_weights + 1e-10) * mask).sum(dim=-1) / lengths).exp()
    # Each sequence's loss on its tokens: seq-mean-token-mean of this is the mean over sequences.
    loss = aggregate_loss(pg_losses[:, None].expand_as(mask), mask, LossAggMode.SEQ_MEAN_TOKEN_MEAN)
    clipped = (negative_approx_kl != negative_approx_kl_clamp).to(mask.dtype)
    return loss, _metrics(
        masked_mean(clipped * (advantages > 0), mask),
        masked_mean(-negative_approx_kl, mask),
        masked_mean(clipped * (advantages < 0), mask),
    )


POLICY_LOSSES: dict[PolicyLoss, PolicyLossFn] = {
    PolicyLoss.VANILLA: vanilla_policy_loss,
    PolicyLoss.GSPO: gspo_policy_loss,
    PolicyLoss.CISPO: cispo_policy_loss,
    PolicyLoss.CLIP_COV: clip_cov_policy_loss,
    PolicyLoss.KL_COV: kl_cov_policy_loss,
    PolicyLoss.GPG: gpg_policy_loss,
    PolicyLoss.GEO_MEAN: geo_mean_policy_loss,
    PolicyLoss.REINFORCE: reinforce_policy_loss,
}


def compute_policy_loss(
    name: str | PolicyLoss,
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams = PolicyLossParams(),
    agg_mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`(loss, metrics)` of the policy loss registered as `name`; all tensors `(batch, response_len)`."""
    return POLICY_LOSSES[PolicyLoss(name)](logprob, old_logprob, advantages, mask, params, agg_mode, is_weights)
