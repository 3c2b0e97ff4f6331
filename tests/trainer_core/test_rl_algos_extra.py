"""Dr. GRPO, RLOO, REINFORCE++ estimators, loss aggregation, off-policy correction, KL
controllers and entropy: known values by hand and plain-loop equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import (
    LOSS_AGGREGATORS,
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    LossAggMode,
    aggregate_loss,
    compute_advantages,
    decoupled_policy_loss,
    entropy_from_logits,
    policy_loss,
    truncated_is_weights,
)


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths)[:, None]).float()


def _outcome_batch(
    seed: int, group_ids: list[str], width: int = 6
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Random scalar rewards on each sample's last real token: (token_rewards, mask, scores)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (len(group_ids),), generator=gen).tolist()
    mask = _right_padded_mask(lengths, width)
    scores = torch.rand(len(group_ids), generator=gen)
    token_rewards = torch.zeros(len(group_ids), width)
    token_rewards[torch.arange(len(group_ids)), torch.tensor(lengths) - 1] = scores
    return token_rewards, mask, scores.tolist()


# interleaved groups, a singleton
_GROUP_IDS = ["a"] * 4 + ["b"] * 3 + ["c"] + ["d"] * 4 + ["a"] * 2


def _whiten_loop(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / std for v in values]


# --- advantage estimators --------------------------------------------------------------------


def test_dr_grpo_two_sample_group_gives_plus_minus_half() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones_like(rewards)
    advantages, returns = compute_advantages(
        "dr_grpo", token_rewards=rewards, response_mask=mask, group_ids=["g", "g"]
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))
    assert torch.equal(returns, advantages)


def test_rloo_known_values() -> None:
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    mask = torch.ones_like(rewards)
    advantages, _ = compute_advantages(
        AdvantageEstimator.RLOO, token_rewards=rewards, response_mask=mask, group_ids=[0] * 4
    )
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(
        advantages, torch.tensor([[2 / 3], [-2 / 3], [-2 / 3], [2 / 3]]), atol=1e-6, rtol=0
    )


def _group_loop(scores: list[float], group_ids: list[str], leave_one_out: bool) -> list[float]:
    out = []
    for i, gid in enumerate(group_ids):
        others = [s for s, g in zip(scores, group_ids, strict=True) if g == gid]
        if len(others) == 1:
            out.append(0.0)
            continue
        if leave_one_out:
            rest = [s for j, s in enumerate(scores) if group_ids[j] == gid and j != i]
            out.append(scores[i] - sum(rest) / len(rest))
        else:
            out.append(scores[i] - sum(others) / len(others))
    return out


@pytest.mark.parametrize(("name", "leave_one_out"), [("dr_grpo", False), ("rloo", True)])
def test_group_baselines_match_plain_loop(name: str, leave_one_out: bool) -> None:
    token_rewards, mask, scores = _outcome_batch(2, _GROUP_IDS)
    advantages, returns = compute_advantages(
        name, token_rewards=token_rewards, response_mask=mask, group_ids=_GROUP_IDS
    )
    expected = torch.tensor(_group_loop(scores, _GROUP_IDS, leave_one_out))[:, None] * mask
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(returns, advantages)
    assert advantages[7].abs().sum() == 0  # the singleton "c"


def test_reinforce_pp_matches_plain_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 1, 3, 4]
    mask = _right_padded_mask(lengths, 5)
    rewards = torch.randn(4, 5, generator=gen)  # garbage on padding must not leak in
    gamma = 0.9

    advantages, returns = compute_advantages(
        "reinforce_pp", token_rewards=rewards, response_mask=mask, gamma=gamma
    )
    raw, expected_returns = [], torch.zeros(4, 5)
    for row, n in enumerate(lengths):
        r = rewards[row, :n].tolist()
        ret = [sum(gamma ** (k - t) * r[k] for k in range(t, n)) for t in range(n)]
        expected_returns[row, :n] = torch.tensor(ret)
        raw.extend(ret)
    expected_adv = torch.zeros(4, 5)
    expected_adv[mask.bool()] = torch.tensor(_whiten_loop(raw))  # over every real token
    torch.testing.assert_close(returns, expected_returns, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(advantages, expected_adv, atol=1e-4, rtol=1e-4)


def test_reinforce_pp_baseline_matches_plain_loop() -> None:
    token_rewards, mask, scores = _outcome_batch(4, _GROUP_IDS)
    advantages, returns = compute_advantages(
        "reinforce_pp_baseline",
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=_GROUP_IDS,
    )
    centered = _group_loop(scores, _GROUP_IDS, leave_one_out=False)
    lengths = mask.sum(1).int().tolist()
    per_token = [c for c, n in zip(centered, lengths, strict=True) for _ in range(n)]
    expected = torch.zeros_like(mask)
    expected[mask.bool()] = torch.tensor(_whiten_loop(per_token))
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(returns, advantages)


def test_new_estimators_are_registered() -> None:
    assert {"dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        AdvantageEstimator
    )


# --- loss aggregation ------------------------------------------------------------------------


_LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])
_LOSS_MASK = _right_padded_mask([3, 1, 0], 3)  # the last row has no real token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5.0
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3.0
    ],
)
def test_aggregate_loss_known_values(mode: str, expected: float) -> None:
    assert aggregate_loss(_LOSS_MAT, _LOSS_MASK, mode).item() == pytest.approx(expected)


def test_aggregate_loss_registry_and_unknown_mode() -> None:
    assert set(LOSS_AGGREGATORS) == set(LossAggMode)
    with pytest.raises(ValueError):
        aggregate_loss(_LOSS_MAT, _LOSS_MASK, "seq-sum")


def test_aggregate_loss_gradient_respects_mode() -> None:
    loss_mat = torch.ones(2, 4, requires_grad=True)
    mask = _right_padded_mask([4, 2], 4)
    aggregate_loss(loss_mat, mask, "seq-mean-token-mean").backward()
    # each sequence weighs 1/2, spread over its own tokens
    expected = torch.tensor([[1 / 8] * 4, [1 / 4, 1 / 4, 0, 0]])
    torch.testing.assert_close(loss_mat.grad, expected)


# --- off-policy correction -------------------------------------------------------------------


def test_truncated_is_weights_known_values_and_detached() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    proximal = torch.tensor([[-1.0, -0.5, 0.0, -3.0]], requires_grad=True)
    weights = truncated_is_weights(behaviour, proximal, cap=2.0)
    torch.testing.assert_close(
        weights, torch.tensor([[1.0, math.exp(0.5), 2.0, math.exp(-2.0)]])
    )
    assert not weights.requires_grad


def test_decoupled_loss_equals_ppo_when_proximal_is_behaviour() -> None:
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=gen) * 3
    logprob = old + torch.randn(3, 4, generator=gen) * 0.3
    advantages = torch.randn(3, 4, generator=gen)
    mask = _right_padded_mask([4, 2, 3], 4)
    loss, metrics = decoupled_policy_loss(logprob, old, old, advantages, mask, 0.2, 0.28)
    ppo, ppo_metrics = policy_loss(logprob, old, advantages, mask, 0.2, 0.28)
    torch.testing.assert_close(loss, ppo)
    torch.testing.assert_close(metrics["pg_clipfrac"], ppo_metrics["pg_clipfrac"])
    torch.testing.assert_close(metrics["ppo_kl"], ppo_metrics["ppo_kl"])
    assert metrics["is_weight_mean"].item() == pytest.approx(1.0)


def test_decoupled_loss_known_values_and_gradient() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]])
    proximal = behaviour + torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    ratio = torch.tensor([[1.5, 1.0, 1.0]])  # pi / pi_proximal
    logprob = (proximal + ratio.log()).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones_like(ratio)

    loss, metrics = decoupled_policy_loss(
        logprob, proximal, behaviour, advantages, mask, is_cap=3.0
    )
    # weights 1, 2, min(4, 3) = 3; per token: -1.2 (clipped), 2 * 1.0, 3 * -2.0
    assert loss.item() == pytest.approx((-1.2 + 2.0 - 6.0) / 3, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["is_capfrac"].item() == pytest.approx(1 / 3)
    assert metrics["is_weight_mean"].item() == pytest.approx(2.0)
    loss.backward()
    # clipped token has no gradient; at ratio 1: -w * A / n_tokens
    torch.testing.assert_close(logprob.grad, torch.tensor([[0.0, 2 / 3, -2.0]]))


# --- KL controllers --------------------------------------------------------------------------


def test_fixed_kl_controller_never_moves() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "error"),
    [(9.0, 0.2), (6.6, 0.1), (6.0, 0.0), (5.4, -0.1), (0.0, -0.2)],  # clipped to +-0.2
)
def test_adaptive_kl_controller_moves_by_clipped_proportional_error(
    current_kl: float, error: float
) -> None:
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=torch.tensor(current_kl), n_steps=256)
    assert ctl.value == pytest.approx(0.1 * (1 + error * 256 / 10000))


def test_adaptive_kl_controller_direction_over_steps() -> None:
    ctl = AdaptiveKLController(init_coef=0.2, target=1.0, horizon=100)
    for _ in range(3):
        ctl.update(2.0, n_steps=10)  # KL too high: penalise more
    assert ctl.value == pytest.approx(0.2 * 1.02**3)
    high = ctl.value
    ctl.update(0.5, n_steps=10)  # KL too low: penalise less
    assert ctl.value == pytest.approx(high * 0.98)


# --- entropy ---------------------------------------------------------------------------------


def test_entropy_from_logits_matches_categorical_and_shape() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 11, generator=gen) * 4
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (2, 3)
    torch.testing.assert_close(
        entropy, torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5, rtol=1e-5
    )
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))


def test_entropy_from_logits_is_stable() -> None:
    huge = torch.tensor([[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]])
    entropy = entropy_from_logits(huge)
    torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(3)]), atol=1e-5, rtol=0)
    masked = torch.tensor([0.0, 0.0, float("-inf")])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2))
