"""DAPO's overlong reward shaping, by hand and against verl's per-sample formula."""

from __future__ import annotations

import pytest
import torch

from trainer_core.algos.reward_shaping import overlong_penalty


def test_overlong_penalty_known_values() -> None:
    lengths = torch.tensor([4.0, 6.0, 8.0, 10.0])  # max_new_tokens 10, a buffer of 4 from 6 on
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 0, 1.0), torch.zeros(4))  # off


@pytest.mark.parametrize(("max_new_tokens", "buffer", "penalty"), [(16, 5, 0.7), (9, 9, 2.0)])
def test_overlong_penalty_matches_verls_loop(max_new_tokens: int, buffer: int, penalty: float) -> None:
    lengths = torch.arange(1, max_new_tokens + 1, dtype=torch.float64)
    shaped = overlong_penalty(lengths, max_new_tokens, buffer, penalty)
    for n, got in zip(lengths.tolist(), shaped.tolist(), strict=True):
        exceed = n - (max_new_tokens - buffer)  # verl DAPORewardManager
        assert got == pytest.approx(min(-exceed / buffer * penalty, 0.0))
