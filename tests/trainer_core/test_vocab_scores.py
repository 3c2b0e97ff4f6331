"""The target's log-prob and the entropy from logits, as one autograd function: its values
against torch's distributions, its gradients against autograd's, and large or masked logits."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.vocab_scores import logprob_and_entropy, target_logprob


def test_values_match_a_categorical_distribution() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 11, generator=gen) * 4
    targets = torch.randint(0, 11, (6,), generator=gen)
    logprob, entropy = logprob_and_entropy(logits, targets)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(logprob, dist.log_prob(targets))
    torch.testing.assert_close(entropy, dist.entropy(), atol=1e-5, rtol=1e-5)
    assert logprob_and_entropy(torch.zeros(1, 7), torch.tensor([3]))[1].item() == pytest.approx(math.log(7))


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradients_are_autograds(with_entropy: bool) -> None:
    """In float64 against finite differences, with a loss weighing every token's log-prob and
    entropy differently (or the log-prob alone, the entropy's gradient then None)."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 9, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 9, (5,), generator=gen)
    weights = torch.rand(2, 5, generator=gen, dtype=torch.float64)

    def loss(z: torch.Tensor) -> torch.Tensor:
        logprob, entropy = logprob_and_entropy(z, targets)
        return (weights[0] * logprob).sum() + ((weights[1] * entropy).sum() if with_entropy else 0)

    assert torch.autograd.gradcheck(loss, (logits,))


def test_the_log_prob_is_the_one_taken_without_the_entropy_to_the_bit() -> None:
    """A KL term between the policy scored with its entropy (an update) and without (the
    reference, the same weights) must be exactly 0: AdamW turns rounding into a step."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(8)) * 5
    targets = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(9))
    assert torch.equal(logprob_and_entropy(logits, targets)[0], target_logprob(logits, targets))


def test_large_and_masked_logits() -> None:
    huge = torch.tensor([[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]], requires_grad=True)
    logprob, entropy = logprob_and_entropy(huge, torch.tensor([0, 2]))
    torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(3)]), atol=1e-5, rtol=0)
    assert logprob[0].item() == 0.0
    masked = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    logprob, entropy = logprob_and_entropy(masked, torch.tensor([1]))
    assert entropy.item() == pytest.approx(math.log(2))
    (logprob + entropy).sum().backward()
    assert torch.isfinite(masked.grad).all() and masked.grad[0, 2] == 0
