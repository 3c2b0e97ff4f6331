"""The RL math: advantage estimators, KL estimators and controllers, policy and value losses.

Pure torch functions, tensors in and `(tensor, metrics)` out; the trainer composes them and
always dispatches estimators by name through the registries. Shapes: `batch` samples,
`response_len` response tokens (right-padded, `mask` 1 on real tokens).

    advantages  estimators of (advantages, returns), `ADV_ESTIMATORS`, `compute_advantages`
    kl          per-token KL estimators (`kl_penalty`) and the KL coefficient's controllers
    policy_losses  the policy losses (PPO, GSPO, CISPO, Clip-/KL-Cov, GPG, GMPO, REINFORCE),
                `POLICY_LOSSES`, `compute_policy_loss`
    losses      value loss, aggregation, truncated importance weights, entropy
    stats       masked mean and whitening, the log-ratio clamp
"""

from contracts.training import AdvantageEstimator, KLEstimator, LossAggMode, PolicyLoss
from trainer_core.algos.advantages import (
    ADV_ESTIMATORS,
    AdvantageFn,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from trainer_core.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from trainer_core.algos.losses import (
    LOSS_AGGREGATORS,
    aggregate_loss,
    aggregation_weight,
    truncated_is_weights,
    value_loss,
)
from trainer_core.algos.policy_losses import POLICY_LOSSES, PolicyLossParams, compute_policy_loss
from trainer_core.algos.stats import MAX_LOG_RATIO, masked_mean, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATORS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageFn",
    "FixedKLController",
    "KLEstimator",
    "LossAggMode",
    "PolicyLoss",
    "PolicyLossParams",
    "aggregate_loss",
    "aggregation_weight",
    "compute_advantages",
    "compute_policy_loss",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "opo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "truncated_is_weights",
    "value_loss",
]
