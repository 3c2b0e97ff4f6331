"""The policy-loss registry: each loss against hand-computed values, and against a plain
per-token loop written from verl's `core_algos.py` formulas."""

from __future__ import annotations

import math

import pytest
import torch

from contracts.training import LossAggMode, PolicyLoss, TrainConfig
from trainer_core.algos import POLICY_LOSSES, PolicyLossParams, compute_policy_loss


def _one_row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


def test_every_policy_loss_is_registered_and_selectable_from_the_run_spec() -> None:
    assert set(POLICY_LOSSES) == set(PolicyLoss)
    assert TrainConfig(policy_loss="gspo").effective_loss_agg == LossAggMode.SEQ_MEAN_TOKEN_MEAN
    assert TrainConfig(policy_loss="cispo", loss_agg="token-sum").effective_loss_agg == LossAggMode.TOKEN_SUM
    with pytest.raises(ValueError):
        TrainConfig(policy_loss="ppo2")
    with pytest.raises(ValueError, match="clip_cov_lb"):
        TrainConfig(clip_cov_lb=5.0, clip_cov_ub=1.0)


def test_gspo_clips_the_sequence_ratio_known_values() -> None:
    old = _one_row(-1.0, -1.0)
    logprob = (old + _one_row(math.log(2.0), 0.0)).requires_grad_()  # s = exp(log(2) / 2) = 1.4142
    loss, metrics = compute_policy_loss("gspo", logprob, old, _one_row(1.0, 1.0), torch.ones_like(old))
    assert loss.item() == pytest.approx(-1.2)  # A > 0: clipped at 1 + 0.2 on both tokens
    assert metrics["pg_clipfrac"].item() == 1.0
    loss, _ = compute_policy_loss("gspo", logprob, old, _one_row(-1.0, -1.0), torch.ones_like(old))
    assert loss.item() == pytest.approx(math.sqrt(2.0))  # A < 0: the unclipped -A s is larger
    loss.backward()
    # Each token's ratio has the value s and the gradient s d logp_t; the sequence mean halves it.
    torch.testing.assert_close(logprob.grad, _one_row(math.sqrt(2) / 2, math.sqrt(2) / 2))


def test_cispo_clips_the_weight_not_the_gradient_known_values() -> None:
    old = _one_row(-1.0 - math.log(1.5), -2.0 - math.log(0.5))
    logprob = _one_row(-1.0, -2.0).requires_grad_()  # ratios 1.5, 0.5
    loss, metrics = compute_policy_loss("cispo", logprob, old, _one_row(1.0, 1.0), torch.ones_like(old))
    # -sg[clip(r)] A log pi: -1.2 * -1 = 1.2 and -0.8 * -2 = 1.6
    assert loss.item() == pytest.approx(1.4)
    loss.backward()
    torch.testing.assert_close(logprob.grad, _one_row(-0.6, -0.4))  # both tokens keep a gradient
    assert metrics["pg_clipfrac"].item() == 1.0


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
def test_gpg_and_reinforce_are_minus_advantage_times_logprob(name: str) -> None:
    logprob = _one_row(-1.0, -2.0).requires_grad_()
    loss, _ = compute_policy_loss(name, logprob, logprob.detach() - 5.0, _one_row(1.0, -1.0), torch.ones(1, 2))
    assert loss.item() == pytest.approx((1.0 - 2.0) / 2)  # far off-policy: no ratio, no clip
    loss.backward()
    torch.testing.assert_close(logprob.grad, _one_row(-0.5, 0.5))


# Advantages and log-probs whose covariances (A - 0.25)(logp + 2.5) are 2.625, 0.375, 0.625, 1.875.
_COV_ADVANTAGES = _one_row(2.0, 1.0, -1.0, -1.0)
_COV_LOGPROB = _one_row(-1.0, -2.0, -3.0, -4.0)


def test_kl_cov_penalises_the_highest_covariance_token_known_values() -> None:
    old = _COV_LOGPROB - _one_row(0.5, 0.0, 0.0, 0.0)  # token 0's ratio is e^0.5
    params = PolicyLossParams(kl_cov_ratio=0.25, ppo_kl_coef=1.0)  # max(1, int(4 * 0.25)) = 1 token
    loss, metrics = compute_policy_loss("kl_cov", _COV_LOGPROB, old, _COV_ADVANTAGES, torch.ones(1, 4), params)
    token0 = -2.0 * math.exp(0.5) + 0.5  # -A r + |log r|, unclipped
    assert loss.item() == pytest.approx((token0 - 1.0 + 1.0 + 1.0) / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(0.125)  # verl reports the mean |log r|


def test_clip_cov_cuts_the_gradient_of_tokens_in_the_covariance_window() -> None:
    logprob = _COV_LOGPROB.clone().requires_grad_()
    # Window (0.5, 2.0): tokens 2 and 3; one of them (max(1, int(4 * 0.25))) is cut at random.
    params = PolicyLossParams(clip_cov_ratio=0.25, clip_cov_lb=0.5, clip_cov_ub=2.0)
    loss, metrics = compute_policy_loss("clip_cov", logprob, _COV_LOGPROB, _COV_ADVANTAGES, torch.ones(1, 4), params)
    assert loss.item() == pytest.approx((-2.0 - 1.0 + 1.0) / 4)  # at ratio 1, -A; one +1 token gone
    assert metrics["pg_clipfrac"].item() == 0.25
    loss.backward()
    cut = logprob.grad[0] == 0
    assert cut.sum() == 1 and bool(cut[2] | cut[3])
    torch.testing.assert_close(logprob.grad[0, :2], torch.tensor([-0.5, -0.25], dtype=torch.float64))


@pytest.mark.parametrize(
    ("advantage", "log_ratio", "field"), [(1.0, 0.05, "pg_clipfrac"), (-1.0, 0.1, "pg_clipfrac_lower")]
)
def test_geo_mean_clips_token_log_ratios_on_the_advantage_side(advantage: float, log_ratio: float, field: str) -> None:
    old = _one_row(-1.0, -1.0)
    logprob = old + _one_row(0.3, -0.1)
    loss, metrics = compute_policy_loss("geo_mean", logprob, old, _one_row(advantage, advantage), torch.ones(1, 2))
    # A > 0: 0.3 clipped to 0.2, ratio exp((0.2 - 0.1) / 2); A < 0: the larger 0.3 kept, exp(0.1)
    assert loss.item() == pytest.approx(-advantage * math.exp(log_ratio))
    assert metrics[field].item() == 0.5


# --- each loss against a plain loop ------------------------------------------------------------


def _loop_aggregate(losses: list[list[float]], mask: list[list[float]], mode: str) -> float:
    rows = [[x for x, m in zip(row, mrow, strict=True) if m] for row, mrow in zip(losses, mask, strict=True)]
    width = len(mask[0])
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "token-sum":
        return sum(map(sum, rows))
    if mode == "seq-mean-token-sum-norm":
        return sum(map(sum, rows)) / sum(1 for r in rows if r) / width
    seq = [sum(r) if mode == "seq-mean-token-sum" else sum(r) / len(r) for r in rows if r]
    return sum(seq) / len(seq)


def _loop_loss(name: str, logp, old, adv, mask, p: PolicyLossParams, mode: str, w) -> float:
    """The loss of `name` token by token, from verl's formulas; `w` the IS weights."""
    n, width = len(mask), len(mask[0])
    clip = lambda r: min(max(r, 1 - p.clip_low), 1 + p.clip_high)  # noqa: E731
    real = [(i, t) for i in range(n) for t in range(width) if mask[i][t]]
    if name in ("gspo", "geo_mean"):
        per_seq = []
        for i in range(n):
            ts = [t for t in range(width) if mask[i][t]]
            if name == "gspo":
                s = math.exp(sum(logp[i][t] - old[i][t] for t in ts) / len(ts))
                per_seq.append(sum(max(-adv[i][t] * s, -adv[i][t] * clip(s)) * w[i][t] for t in ts) / len(ts))
            else:
                clipped = []
                for t in ts:
                    d = logp[i][t] - old[i][t]
                    dc = min(max(d, -p.clip_low), p.clip_high)
                    clipped.append(max(d, dc) if adv[i][t] < 0 else min(d, dc) if adv[i][t] > 0 else 0.0)
                a = sum(adv[i][t] for t in ts) / len(ts)
                seq_w = math.exp(sum(math.log(w[i][t] + 1e-10) for t in ts) / len(ts))
                per_seq.append(-a * math.exp(sum(clipped) / len(ts)) * seq_w)
        return sum(per_seq) / n
    losses = [[0.0] * width for _ in range(n)]
    if name == "kl_cov":
        mean_a = sum(adv[i][t] for i, t in real) / len(real)
        mean_l = sum(logp[i][t] for i, t in real) / len(real)
        cov = {(i, t): (adv[i][t] - mean_a) * (logp[i][t] - mean_l) for i, t in real}
        top = set(sorted(cov, key=cov.get, reverse=True)[: max(1, int(len(real) * p.kl_cov_ratio))])
    for i, t in real:
        r = math.exp(logp[i][t] - old[i][t])
        a = adv[i][t]
        if name == "vanilla":
            loss = max(-a * r, -a * clip(r))
            loss = min(loss, -a * p.clip_c) if p.clip_c and a < 0 else loss
        elif name == "cispo":
            loss = -clip(r) * a * logp[i][t]
        elif name in ("gpg", "reinforce"):
            loss = -a * logp[i][t]
        else:  # kl_cov
            loss = -a * r + (p.ppo_kl_coef * abs(logp[i][t] - old[i][t]) if (i, t) in top else 0.0)
        losses[i][t] = loss * w[i][t]
    return _loop_aggregate(losses, mask, mode)


_LOOPED = [loss for loss in PolicyLoss if loss != PolicyLoss.CLIP_COV]  # clip_cov draws at random: below


@pytest.mark.parametrize("mode", list(LossAggMode))
@pytest.mark.parametrize("name", _LOOPED)
def test_policy_losses_match_a_plain_loop(name: PolicyLoss, mode: LossAggMode) -> None:
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    logprob = old + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3
    advantages = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([5, 2, 4])[:, None]).double()
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.5
    params = PolicyLossParams(0.2, 0.28, clip_c=3.0, kl_cov_ratio=0.2, ppo_kl_coef=0.7)
    loss, _ = compute_policy_loss(name, logprob, old, advantages, mask, params, mode, weights)
    agg = mode if name not in ("gspo", "geo_mean") else "seq-mean-token-mean"  # theirs, as verl
    args = [x.tolist() for x in (logprob, old, advantages, mask)]
    expected = _loop_loss(name, *args, params, agg, weights.tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-7)  # geo_mean: verl's + 1e-8 on lengths


def test_clip_cov_matches_a_plain_loop_when_every_candidate_is_cut() -> None:
    gen = torch.Generator().manual_seed(12)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    logprob = old + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.3
    advantages = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 2
    mask = (torch.arange(6) < torch.tensor([6, 3, 5, 1])[:, None]).double()
    params = PolicyLossParams(0.2, 0.2, clip_cov_ratio=1.0, clip_cov_lb=0.1, clip_cov_ub=2.0)
    loss, metrics = compute_policy_loss("clip_cov", logprob, old, advantages, mask, params)

    real = [(i, t) for i in range(4) for t in range(6) if mask[i, t]]
    mean_a = sum(advantages[i, t].item() for i, t in real) / len(real)
    mean_l = sum(logprob[i, t].item() for i, t in real) / len(real)
    total, n_cut = 0.0, 0
    for i, t in real:
        r, a = math.exp(logprob[i, t] - old[i, t]), advantages[i, t].item()
        l1, l2 = -a * r, -a * min(max(r, 0.8), 1.2)
        cov = (a - mean_a) * (logprob[i, t].item() - mean_l)
        cut = not l2 > l1 and 0.1 < cov < 2.0  # clip_num = every token: all candidates are cut
        n_cut += cut
        total += 0.0 if cut else max(l1, l2)
    assert n_cut > 0
    assert loss.item() == pytest.approx(total / len(real), rel=1e-9)
    assert metrics["pg_clipfrac"].item() == pytest.approx(n_cut / len(real))
