"""Masked mean and whitening."""

from __future__ import annotations

import pytest
import torch

from trainer_core.algos import masked_mean, masked_whiten


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
