"""Clipped surrogate (dual clip, decoupled with truncated IS), value loss, loss aggregation and
entropy: known values by hand, gradients, and plain-loop equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import (
    LOSS_AGGREGATORS,
    LossAggMode,
    PolicyLossParams,
    aggregate_loss,
    truncated_is_weights,
    value_loss,
)
from trainer_core.algos.policy_losses import vanilla_policy_loss as policy_loss


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths)[:, None]).float()


def test_policy_loss_with_dual_clip_known_values() -> None:
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.1]])
    old_logprob = torch.full_like(ratio, -2.0)
    logprob = old_logprob + ratio.log()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones_like(ratio)

    loss, metrics = policy_loss(logprob, old_logprob, advantages, mask, PolicyLossParams(0.2, 0.2, clip_c=3.0))
    # per token: -1.2 (clipped at 1.2), 0.8 (clipped at 0.8), 3.0 (dual clip), -1.1 (inside)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.1) / 4, abs=1e-6)
    assert loss.item() == pytest.approx(0.375, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)  # the first two tokens
    assert metrics["ppo_kl"].item() == pytest.approx(-ratio.log().mean().item(), abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # the dual-clipped third token

    loss_no_dual, _ = policy_loss(logprob, old_logprob, advantages, mask)
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


_LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])


_LOSS_MASK = _right_padded_mask([3, 1, 0], 3)  # the last row has no real token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5.0
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3.0
        ("token-sum", 1 + 2 + 3 + 4),  # 10
        ("seq-mean-token-sum-norm", (6 + 4) / 2 / 3),  # seq-mean-token-sum over the padded length 3
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


def test_truncated_is_weights_known_values_and_detached() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    proximal = torch.tensor([[-1.0, -0.5, 0.0, -3.0]], requires_grad=True)
    weights, metrics = truncated_is_weights(behaviour, proximal, torch.ones(1, 4), cap=2.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 2.0, math.exp(-2.0)]])
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    assert metrics["is_capfrac"].item() == pytest.approx(0.25)
    assert metrics["is_weight_mean"].item() == pytest.approx(expected.mean().item())


def test_sequence_level_and_batch_normalised_is_weights_known_values() -> None:
    behaviour = torch.zeros(2, 3)
    # sequence 0: log ratios 0.1 + 0.2 (+ 5 on padding, ignored) -> exp(0.3); sequence 1: 1 + 1 + 1 -> e^3, capped
    proximal = torch.tensor([[0.1, 0.2, 5.0], [1.0, 1.0, 1.0]])
    mask = _right_padded_mask([2, 3], 3)
    weights, metrics = truncated_is_weights(behaviour, proximal, mask, cap=4.0, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[math.exp(0.3)] * 2 + [0.0], [4.0] * 3]))
    assert metrics["is_capfrac"].item() == pytest.approx(3 / 5)
    normalised, _ = truncated_is_weights(behaviour, proximal, mask, cap=4.0, level="sequence", batch_normalize=True)
    seq_mean = (math.exp(0.3) + 4.0) / 2  # one weight per sequence, then their mean
    torch.testing.assert_close(normalised, weights / seq_mean)
    token_normalised, _ = truncated_is_weights(behaviour, proximal, mask, cap=4.0, batch_normalize=True)
    token_weights = torch.tensor([[math.exp(0.1), math.exp(0.2), 0.0], [math.e] * 3])
    torch.testing.assert_close(token_normalised, token_weights / (token_weights.sum() / 5))


def test_decoupled_loss_equals_ppo_when_proximal_is_behaviour() -> None:
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=gen) * 3
    logprob = old + torch.randn(3, 4, generator=gen) * 0.3
    advantages = torch.randn(3, 4, generator=gen)
    mask = _right_padded_mask([4, 2, 3], 4)
    weights, is_metrics = truncated_is_weights(old, old, mask, cap=2.0)
    params = PolicyLossParams(0.2, 0.28)
    loss, metrics = policy_loss(logprob, old, advantages, mask, params, is_weights=weights)
    ppo, ppo_metrics = policy_loss(logprob, old, advantages, mask, params)
    torch.testing.assert_close(loss, ppo)
    torch.testing.assert_close(metrics["pg_clipfrac"], ppo_metrics["pg_clipfrac"])
    torch.testing.assert_close(metrics["ppo_kl"], ppo_metrics["ppo_kl"])
    assert is_metrics["is_weight_mean"].item() == pytest.approx(1.0)


def test_decoupled_loss_known_values_and_gradient() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]])
    proximal = behaviour + torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])
    ratio = torch.tensor([[1.5, 1.0, 1.0]])  # pi / pi_proximal
    logprob = (proximal + ratio.log()).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones_like(ratio)

    weights, is_metrics = truncated_is_weights(behaviour, proximal, mask, cap=3.0)
    loss, metrics = policy_loss(logprob, proximal, advantages, mask, is_weights=weights)
    # weights 1, 2, min(4, 3) = 3; per token: -1.2 (clipped), 2 * 1.0, 3 * -2.0
    assert loss.item() == pytest.approx((-1.2 + 2.0 - 6.0) / 3, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert is_metrics["is_capfrac"].item() == pytest.approx(1 / 3)
    assert is_metrics["is_weight_mean"].item() == pytest.approx(2.0)
    loss.backward()
    # clipped token has no gradient; at ratio 1: -w * A / n_tokens
    torch.testing.assert_close(logprob.grad, torch.tensor([[0.0, 2 / 3, -2.0]]))
