"""KL to the reference policy: per-token estimators registered by name, and the controllers
(fixed or adaptive) of the KL coefficient. Pure torch and plain floats."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from contracts.training import KLEstimator
from trainer_core.algos.stats import MAX_LOG_RATIO


# --- estimators ------------------------------------------------------------------------------


# Estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi
# (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).
def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _kl_k3(log_ratio: Tensor) -> Tensor:
    ref_log_ratio = (-log_ratio).clamp(max=MAX_LOG_RATIO)
    return ref_log_ratio.exp() - ref_log_ratio - 1


KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.K1: _kl_k1,
    KLEstimator.K2: _kl_k2,
    KLEstimator.K3: _kl_k3,
}


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str | KLEstimator) -> Tensor:
    """Per-token KL estimate, `(batch, response_len)`, with r = logp_ref - logp:
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1 (unbiased, and never negative)."""
    return KL_ESTIMATORS[KLEstimator(kind)](logprob - ref_logprob)


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
