"""Advantage estimators: known values by hand and plain-loop equivalence, and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import ADV_ESTIMATORS, AdvantageEstimator, compute_advantages


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths)[:, None]).float()


def test_grpo_two_sample_group_gives_plus_minus_0_7071() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # scalar reward on the last token
    mask = torch.ones_like(rewards)
    advantages, returns = compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=["g", "g"])
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) * 0.70710678, atol=1e-5, rtol=0)
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
    group_ids = ["a"] * 4 + ["b"] * 3 + ["c"] + ["d"] * 4 + ["a"] * 2  # interleaved, a singleton, a tie
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


def _gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
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
        compute_advantages("reinforce++", token_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))


def _outcome_batch(seed: int, group_ids: list[str], width: int = 6) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
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


def test_dr_grpo_two_sample_group_gives_plus_minus_half() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones_like(rewards)
    advantages, returns = compute_advantages("dr_grpo", token_rewards=rewards, response_mask=mask, group_ids=["g", "g"])
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))
    assert torch.equal(returns, advantages)


def test_rloo_known_values() -> None:
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    mask = torch.ones_like(rewards)
    advantages, _ = compute_advantages(
        AdvantageEstimator.RLOO, token_rewards=rewards, response_mask=mask, group_ids=[0] * 4
    )
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(advantages, torch.tensor([[2 / 3], [-2 / 3], [-2 / 3], [2 / 3]]), atol=1e-6, rtol=0)


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

    advantages, returns = compute_advantages("reinforce_pp", token_rewards=rewards, response_mask=mask, gamma=gamma)
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
    assert {"dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(AdvantageEstimator)


def test_reinforce_pp_returns_carry_across_mask_holes() -> None:
    """A tool observation (mask 0) inside a response is not a step: the later turn's return
    reaches the earlier turn undiscounted by it (verl PR #7300); trailing padding stays 0."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 7.0, 0.0, 0.0, 1.0, 3.0]])  # rewards off the mask are dropped
    _, returns = compute_advantages("reinforce_pp", token_rewards=rewards, response_mask=mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0, 0.0]]))


@pytest.mark.parametrize("name", [e for e in AdvantageEstimator if e != AdvantageEstimator.GAE])
def test_estimators_keep_the_input_dtype(name: str) -> None:
    token_rewards, mask, _ = _outcome_batch(7, ["a", "a", "b", "b"])
    advantages, returns = compute_advantages(
        name,
        token_rewards=token_rewards.double(),
        response_mask=mask.double(),
        group_ids=["a", "a", "b", "b"],
        reward_baselines=torch.full((4,), 0.5, dtype=torch.float64),
    )
    assert advantages.dtype == returns.dtype == torch.float64


def test_remax_subtracts_the_greedy_reward_from_the_return_known_values() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.2, 0.0]])
    mask = _right_padded_mask([3, 2], 3)
    advantages, returns = compute_advantages(
        "remax", token_rewards=rewards, response_mask=mask, reward_baselines=torch.tensor([0.4, 0.5])
    )
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.2, 0.2, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.6, 0.6, 0.6], [-0.3, -0.3, 0.0]]))


def test_remax_matches_plain_loop() -> None:
    gen = torch.Generator().manual_seed(8)
    lengths = [4, 1, 3]
    mask = _right_padded_mask(lengths, 4)
    rewards = torch.randn(3, 4, generator=gen)
    baselines = torch.randn(3, generator=gen)
    advantages, returns = compute_advantages(
        "remax", token_rewards=rewards, response_mask=mask, reward_baselines=baselines
    )
    for row, n in enumerate(lengths):
        for t in range(4):
            ret = sum(rewards[row, k].item() for k in range(t, n))
            assert returns[row, t].item() == pytest.approx(ret, abs=1e-6)
            assert advantages[row, t].item() == pytest.approx(ret - baselines[row].item() if t < n else 0.0, abs=1e-6)


def test_opo_length_weighted_baseline_known_values() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.7]])
    mask = _right_padded_mask([1, 3, 3], 3)
    advantages, _ = compute_advantages("opo", token_rewards=rewards, response_mask=mask, group_ids=["g", "g", "solo"])
    # baseline (1 * 1 + 3 * 0) / (1 + 3) = 0.25; a group of one has baseline 0 (as verl)
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.0, 0.0], [-0.25] * 3, [0.7] * 3]))


def test_opo_matches_plain_loop() -> None:
    token_rewards, mask, scores = _outcome_batch(9, _GROUP_IDS)
    advantages, _ = compute_advantages("opo", token_rewards=token_rewards, response_mask=mask, group_ids=_GROUP_IDS)
    lengths = mask.sum(1).tolist()
    for i, g in enumerate(_GROUP_IDS):
        members = [j for j, h in enumerate(_GROUP_IDS) if h == g]
        baseline = (
            sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members) if len(members) > 1 else 0.0
        )
        assert advantages[i, 0].item() == pytest.approx(scores[i] - baseline, abs=1e-6)


def test_grpo_passk_rewards_only_the_best_known_values() -> None:
    scores = torch.tensor([0.0, 2.0, 1.0, 1.0, 1.0])
    advantages, _ = compute_advantages(
        "grpo_passk", token_rewards=scores[:, None], response_mask=torch.ones(5, 1), group_ids=["a"] * 3 + ["b"] * 2
    )
    # a: (2 - 1) / (std [0, 2, 1] = 1, + 1e-6); b: a tie, the first best gets 1 - 1 = 0
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages(
            "grpo_passk", token_rewards=scores[:1, None], response_mask=torch.ones(1, 1), group_ids=["a"]
        )


def test_grpo_passk_matches_verls_loop() -> None:
    group_ids = ["a"] * 4 + ["b"] * 3 + ["d"] * 4 + ["a"] * 2
    token_rewards, mask, _ = _outcome_batch(10, group_ids)
    token_rewards = token_rewards.round(decimals=1)  # ties
    advantages, _ = compute_advantages(
        "grpo_passk", token_rewards=token_rewards, response_mask=mask, group_ids=group_ids
    )
    scores = token_rewards.sum(-1)
    expected = torch.zeros(len(group_ids))
    for g in dict.fromkeys(group_ids):  # verl: topk(2) per group, the first index of the best
        members = [i for i, h in enumerate(group_ids) if h == g]
        rewards = scores[members]
        best = max(range(len(members)), key=lambda k: (rewards[k].item(), -k))
        rest = [rewards[k].item() for k in range(len(members)) if k != best]
        expected[members[best]] = (rewards[best] - max(rest)) / (torch.std(rewards) + 1e-6)
    torch.testing.assert_close(advantages, expected[:, None] * mask)
