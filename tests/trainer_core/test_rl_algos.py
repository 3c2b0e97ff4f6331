from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths)[:, None]).float()


def test_masked_mean_and_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = _right_padded_mask([2, 1], 3)
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 3.0]))
    white = masked_whiten(x, mask)
    values = white[mask.bool()]
    assert values.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert values.std().item() == pytest.approx(1.0, abs=1e-4)  # unbiased, like torch.std


@pytest.mark.parametrize(
    ("kind", "expected"), [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) + 0.5 - 1)]
)
def test_kl_estimators_known_values(kind: str, expected: float) -> None:
    kl = kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.5]), kind)
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    if kind == "k3":
        assert kl.item() == pytest.approx(0.10653, abs=1e-5)


def test_kl_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_policy_loss_with_dual_clip_known_values() -> None:
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.1]])
    old_logprob = torch.full_like(ratio, -2.0)
    logprob = old_logprob + ratio.log()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones_like(ratio)

    loss, metrics = policy_loss(logprob, old_logprob, advantages, mask, 0.2, 0.2, clip_c=3.0)
    # per token: -1.2 (clipped at 1.2), 0.8 (clipped at 0.8), 3.0 (dual clip), -1.1 (inside)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.1) / 4, abs=1e-6)
    assert loss.item() == pytest.approx(0.375, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)  # the first two tokens
    assert metrics["ppo_kl"].item() == pytest.approx(-ratio.log().mean().item(), abs=1e-6)

    loss_no_dual, _ = policy_loss(logprob, old_logprob, advantages, mask, 0.2, 0.2)
    assert loss_no_dual.item() == pytest.approx((-1.2 + 0.8 + 5.0 - 1.1) / 4, abs=1e-6)


def test_policy_loss_ignores_masked_tokens_and_has_the_pg_gradient() -> None:
    old_logprob = torch.tensor([[-1.0, -2.0, -3.0]])
    logprob = old_logprob.clone().requires_grad_()
    advantages = torch.tensor([[2.0, -1.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(logprob, old_logprob, advantages, mask)
    loss.backward()
    # At ratio 1: d loss / d logprob = -A / n_tokens on real tokens, 0 on padding.
    torch.testing.assert_close(logprob.grad, torch.tensor([[-1.0, 0.5, 0.0]]))
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0


def test_value_loss_known_values() -> None:
    old_values = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, -0.5]])
    returns = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones_like(values)
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.2)
    # squared errors, unclipped vs clipped to 0 +- 0.2, the larger kept:
    # 0.25 vs 0.64 -> 0.64 (clipped); 0.81 both; 2.25 vs 1.44 -> 2.25
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3, abs=1e-6)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_grpo_two_sample_group_gives_plus_minus_0_7071() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # scalar reward on the last token
    mask = torch.ones_like(rewards)
    advantages, returns = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=["g", "g"]
    )
    torch.testing.assert_close(
        advantages, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) * 0.70710678, atol=1e-5, rtol=0
    )
    assert torch.equal(returns, advantages)


def _grpo_loop(scores: list[float], group_ids: list[str], eps: float = 1e-6) -> list[float]:
    out = []
    for score, gid in zip(scores, group_ids, strict=True):
        group = [s for s, g in zip(scores, group_ids, strict=True) if g == gid]
        if len(group) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        out.append((score - mean) / (std + eps))
    return out


def test_grpo_matches_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    group_ids = (
        ["a"] * 4 + ["b"] * 3 + ["c"] + ["d"] * 4 + ["a"] * 2
    )  # interleaved, a singleton, a tie
    lengths = torch.randint(1, 7, (len(group_ids),), generator=gen).tolist()
    mask = _right_padded_mask(lengths, 6)
    scores = torch.rand(len(group_ids), generator=gen)
    scores[8:12] = 0.5  # group d: all equal, zero advantage
    token_rewards = torch.zeros(len(group_ids), 6)
    token_rewards[torch.arange(len(group_ids)), torch.tensor(lengths) - 1] = scores

    advantages, _ = compute_advantages(
        AdvantageEstimator.GRPO,
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=group_ids,
    )
    expected = torch.tensor(_grpo_loop(scores.tolist(), group_ids))[:, None] * mask
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)


def _gae_loop(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """GAE of one unpadded episode, straight from the definition."""
    n = len(rewards)
    advantages = []
    for t in range(n):
        total = 0.0
        for k in range(t, n):
            next_value = values[k + 1] if k + 1 < n else 0.0
            delta = rewards[k] + gamma * next_value - values[k]
            total += (gamma * lam) ** (k - t) * delta
        advantages.append(total)
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def test_gae_matches_plain_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 3, 5]
    mask = _right_padded_mask(lengths, 5)
    rewards = torch.randn(4, 5, generator=gen) * mask
    values = torch.randn(4, 5, generator=gen) * 10  # garbage on padding must not leak in
    gamma, lam = 0.9, 0.8

    advantages, returns = compute_advantages(
        "gae", token_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam
    )
    raw, expected_returns = [], torch.zeros(4, 5)
    for row, n in enumerate(lengths):
        adv, ret = _gae_loop(rewards[row, :n].tolist(), values[row, :n].tolist(), gamma, lam)
        raw.extend(adv)
        expected_returns[row, :n] = torch.tensor(ret)
    raw_t = torch.tensor(raw)
    expected_adv = torch.zeros(4, 5)
    expected_adv[mask.bool()] = (raw_t - raw_t.mean()) / raw_t.std()  # whitened over the batch
    torch.testing.assert_close(returns, expected_returns, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(advantages, expected_adv, atol=1e-4, rtol=1e-4)


def test_every_estimator_is_registered_and_unknown_names_fail() -> None:
    assert set(ADV_ESTIMATORS) == set(AdvantageEstimator)
    with pytest.raises(ValueError):
        compute_advantages(
            "reinforce++", token_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1)
        )
