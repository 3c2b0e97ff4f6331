"""KL to the reference policy: per-token estimators registered by name, and the controllers
(fixed or adaptive) of the KL coefficient. Pure torch and plain floats."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from contracts.training import KLEstimator
from trainer_core.algos.stats import MAX_LOG_RATIO

# --- estimators ------------------------------------------------------------------------------


# Estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi
# (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html),
# as verl `kl_penalty_forward`; each takes log_ratio = logp - logp_ref `(batch, response_len)`.
def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _kl_k3(log_ratio: Tensor) -> Tensor:
    ref_log_ratio = (-log_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return ref_log_ratio.exp() - ref_log_ratio - 1


def _straight_through_k2(value: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The value of `value`, the gradient of k2 (verl's "+" estimators): k1 and k3 are unbiased
    estimates of the KL but their gradients are not of the KL's; k2's is."""

    def estimator(log_ratio: Tensor) -> Tensor:
        backward_score = _kl_k2(log_ratio)
        return backward_score - backward_score.detach() + value(log_ratio).detach()

    return estimator


KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.K1: _kl_k1,
    KLEstimator.K2: _kl_k2,
    KLEstimator.K3: _kl_k3,
    KLEstimator.ABS: _kl_abs,
    KLEstimator.K1_PLUS: _straight_through_k2(_kl_k1),
    KLEstimator.K3_PLUS: _straight_through_k2(_kl_k3),
}


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str | KLEstimator, k3_clamp: float = 0.0) -> Tensor:
    """Per-token KL estimate, `(batch, response_len)`, with r = logp_ref - logp:
    k1 = -r, abs = |r|, k2 = r^2 / 2, k3 = exp(r) - r - 1 (unbiased, and never negative);
    k1+ and k3+ have k1's and k3's values and k2's gradient. `k3_clamp` > 0 clamps k3's value
    (and k3+'s) to [-k3_clamp, k3_clamp], as verl does at 10; 0 leaves it unclamped."""
    kind = KLEstimator(kind)
    estimator = KL_ESTIMATORS[kind]
    if k3_clamp > 0 and kind in (KLEstimator.K3, KLEstimator.K3_PLUS):
        clamped_k3 = lambda lr: _kl_k3(lr).clamp(-k3_clamp, k3_clamp)  # noqa: E731
        estimator = clamped_k3 if kind == KLEstimator.K3 else _straight_through_k2(clamped_k3)
    return estimator(logprob - ref_logprob)


# --- controllers of the KL coefficient -------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op (Ziegler et al. 2019, as verl/TRL)."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences",
    as verl/TRL `AdaptiveKLController`): the proportional error current_kl / target - 1, clipped
    to +-0.2, moves the coefficient by value *= 1 + error * n_steps / horizon, so it grows while
    the KL is above target and shrinks while below.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt `value` to the KL `current_kl` measured over the last `n_steps` samples."""
        # float() of a device tensor is a CPU-GPU sync point: pass a float where it matters.
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
