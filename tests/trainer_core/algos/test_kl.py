"""KL estimators (known values) and the KL coefficient's controllers."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import AdaptiveKLController, FixedKLController, kl_penalty


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
