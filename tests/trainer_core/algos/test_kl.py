"""KL estimators (known values) and the KL coefficient's controllers."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.algos import AdaptiveKLController, FixedKLController, kl_penalty


@pytest.mark.parametrize(("kind", "expected"), [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) + 0.5 - 1)])
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
def test_adaptive_kl_controller_moves_by_clipped_proportional_error(current_kl: float, error: float) -> None:
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


@pytest.mark.parametrize(("kind", "value"), [("abs", 0.5), ("k1+", 0.5), ("k3+", math.exp(-0.5) + 0.5 - 1)])
def test_abs_and_straight_through_estimators_value_and_gradient(kind: str, value: float) -> None:
    logprob = torch.tensor([-1.0], requires_grad=True)
    kl = kl_penalty(logprob, torch.tensor([-1.5]), kind)
    assert kl.item() == pytest.approx(value, abs=1e-6)
    kl.backward()
    # abs: d|x|/dx = 1; k1+ and k3+: k2's gradient, logp - logp_ref = 0.5
    assert logprob.grad.item() == pytest.approx(1.0 if kind == "abs" else 0.5)


def test_k3_clamp_is_off_by_default_and_bounds_k3_when_set() -> None:
    logprob, ref = torch.tensor([-20.0]), torch.tensor([-5.0])  # r = 15: k3 = e^15 - 16
    assert kl_penalty(logprob, ref, "k3").item() == pytest.approx(math.exp(15) - 16, rel=1e-5)
    assert kl_penalty(logprob, ref, "k3", k3_clamp=10.0).item() == 10.0
    assert kl_penalty(logprob, ref, "k3+", k3_clamp=10.0).item() == 10.0


def test_kl_estimators_match_their_formulas_elementwise() -> None:
    gen = torch.Generator().manual_seed(1)
    logprob, ref = -torch.rand(3, 4, generator=gen) * 4, -torch.rand(3, 4, generator=gen) * 4
    formulas = {
        "k1": lambda d: d,
        "abs": abs,
        "k2": lambda d: d * d / 2,
        "k3": lambda d: math.exp(-d) + d - 1,
        "k1+": lambda d: d,
        "k3+": lambda d: math.exp(-d) + d - 1,
    }
    for kind, formula in formulas.items():
        kl = kl_penalty(logprob, ref, kind)
        for i in range(3):
            for t in range(4):
                assert kl[i, t].item() == pytest.approx(formula((logprob[i, t] - ref[i, t]).item()), abs=1e-5), kind
