"""The trainer's configuration: the ``training`` section of a run spec, declared once.

The API validates it (and shows it in the OpenAPI document), the scheduler reads the job's
shape from it, and the training job and colocated runs hand it to ``trainer_core`` as it is.
No torch here: the control plane imports this module.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema


class Algorithm(StrEnum):
    GRPO = "grpo"  # critic-free: advantages relative to the prompt's group
    PPO = "ppo"  # a learned critic (value head), advantages by GAE


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"  # (r - group mean) / group std (Shao et al. 2024)
    GAE = "gae"  # generalised advantage estimation with the critic (Schulman et al. 2016)
    DR_GRPO = "dr_grpo"  # r - group mean, no std division (Liu et al. 2025)
    RLOO = "rloo"  # r - mean of the group's other samples (Ahmadian et al. 2024)
    REINFORCE_PP = "reinforce_pp"  # discounted returns whitened over the batch (Hu 2025)
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"  # group mean subtracted, then whitened over the batch
    REMAX = "remax"  # return minus the reward of the prompt's greedy response (Li et al. 2023)
    OPO = "opo"  # r - the group's length-weighted mean reward (Hao et al. 2025)
    GRPO_PASSK = "grpo_passk"  # only the group's best sample: (r_max - r_second) / std (Chen et al. 2025)


class PolicyLoss(StrEnum):
    """Policy losses, by verl's names (`actor.policy_loss.loss_mode`)."""

    VANILLA = "vanilla"  # PPO clipped surrogate with dual clip (Schulman et al. 2017)
    GSPO = "gspo"  # clipped sequence-level ratio (Zheng et al. 2025)
    CISPO = "cispo"  # clipped, stop-gradient IS weight times log-prob (MiniMax-M1, 2025)
    CLIP_COV = "clip_cov"  # PPO with high-covariance tokens' gradient cut (Cui et al. 2025)
    KL_COV = "kl_cov"  # unclipped ratio, |log ratio| penalty on high-covariance tokens (Cui et al. 2025)
    GPG = "gpg"  # -A log pi, no ratio (Chu et al. 2025)
    GEO_MEAN = "geo_mean"  # geometric mean of clipped token ratios per sequence, GMPO (Zhao et al. 2025)
    REINFORCE = "reinforce"  # -A log pi, no clipping (Williams 1992)


class ISLevel(StrEnum):
    """What one truncated importance weight covers (verl `rollout_is`)."""

    TOKEN = "token"  # each token its own ratio (biased, low variance)
    SEQUENCE = "sequence"  # the product of a sequence's token ratios, on all its tokens (unbiased)


class KLEstimator(StrEnum):
    """Estimators of KL(pi || pi_ref) from sampled tokens (Schulman 2020, "Approximating KL Divergence")."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    ABS = "abs"  # |log pi - log pi_ref|
    K1_PLUS = "k1+"  # value of k1, gradient of k2 (straight-through)
    K3_PLUS = "k3+"  # value of k3, gradient of k2 (straight-through)


class LossAggMode(StrEnum):
    TOKEN_MEAN = "token-mean"  # every real token weighs the same (DAPO)
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # sum over a sequence's tokens, mean over sequences
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # mean over a sequence's tokens, then over sequences (GRPO)
    TOKEN_SUM = "token-sum"  # sum over every real token of the mini-batch
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # seq-mean-token-sum over response_len (Dr. GRPO)


class KLMode(StrEnum):
    LOSS = "loss"  # kl_coef * KL(pi || ref) added to the loss (GRPO)
    REWARD = "reward"  # kl_coef * KL(behaviour || ref) subtracted from the token rewards (classic PPO)


class OffPolicy(StrEnum):
    """How the loss corrects for samples drawn by an older policy version."""

    # The clipped ratio is taken against the behaviour log-probs the workers recorded.
    BEHAVIOUR = "behaviour"
    # Decoupled PPO (Hilton et al. 2021) with truncated IS: the ratio is clipped around the
    # proximal policy (this update's starting weights, scored once more), and each token is
    # weighted by min(pi_proximal / pi_behaviour, is_cap). Costs one extra no-grad forward pass.
    DECOUPLED = "decoupled"


class Critic(StrEnum):
    SHARED = "shared"  # a value head on the policy's own (detached) hidden states
    SEPARATE = "separate"  # a value head on a separate copy of the base model, trained too


class Strategy(StrEnum):
    """Data-parallel strategy of a job with more than one process."""

    FSDP2 = "fsdp2"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


# A cloud zone, by the name Kubernetes gives its nodes (the topology.kubernetes.io/zone label's value).
Zone = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$")]


class TrainingCapacity(StrEnum):
    """The capacity a training job's node is bought on."""

    ON_DEMAND = "on-demand"
    SPOT = "spot"  # checkpointed within the update; a preempted job resumes from its checkpoint
    AUTO = "auto"  # spot while its expected cost is the lower, else on-demand


class TrainConfig(BaseModel):
    """Hyper-parameters of one RL update, and the shape of the job that runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # every number finite

    # --- set from the run, not in the section: one declaration each, in the run spec ---------
    algorithm: SkipJsonSchema[Algorithm] = Field(
        default=Algorithm.GRPO, exclude=True, description="The run's `algorithm`."
    )
    temperature: SkipJsonSchema[float] = Field(
        default=1.0,
        ge=0.0,
        le=5.0,
        exclude=True,
        description="The run's `sampling.temperature`: the behaviour log-probs are of logits / temperature.",
    )
    max_new_tokens: SkipJsonSchema[int] = Field(
        default=64,
        ge=1,
        le=8192,
        exclude=True,
        description="The run's `sampling.max_new_tokens`: the response length limit (overlong shaping, clip ratio).",
    )

    # --- the update ----------------------------------------------------------------------------
    learning_rate: float = Field(
        default=1e-5, ge=0.0, le=1.0, description="AdamW learning rate of the policy (and value head)."
    )
    epochs: int = Field(default=1, ge=1, le=100, description="Passes over each batch.")
    mini_batch: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Samples per optimizer step; 0 = the whole batch (one step per epoch).",
    )
    micro_batch: int = Field(
        default=8,
        ge=0,
        le=4096,
        description="Samples per forward/backward pass (gradient accumulation); 0 = auto: the rule of thumb from the "
        "device's free memory, then on a GPU halved until a trial pass fits.",
    )
    micro_batch_tokens: int = Field(
        default=0,
        ge=0,
        le=100_000_000,
        description="Token budget of a micro-batch (padded rows x longest row); > 0 replaces micro_batch with dynamic "
        "micro-batches of similar lengths.",
    )
    clip_ratio: float = Field(
        default=0.2,
        gt=0.0,
        le=10.0,
        description="PPO clip range of the importance ratio: [1 - clip_ratio, 1 + clip_ratio_high].",
    )
    clip_ratio_high: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="Upper clip of the ratio, 1 + clip_ratio_high (0 = clip_ratio; DAPO's clip-higher uses 0.28).",
    )
    dual_clip: float = Field(
        default=0.0, ge=0.0, le=100.0, description="Dual-clip bound c > 1 on negative-advantage token losses (0 = off)."
    )
    loss_agg: LossAggMode = Field(
        default=LossAggMode.TOKEN_MEAN,
        description="How token losses are averaged: over all tokens, or per sequence then over sequences.",
    )
    adv_estimator: AdvantageEstimator | None = Field(
        default=None, description="Advantage estimator of a critic-free run (None = grpo); ppo always uses gae."
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="PPO discount over response tokens.")
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="PPO GAE lambda.")
    vf_coef: float = Field(default=0.5, ge=0.0, le=100.0, description="Weight of the value loss (PPO).")
    value_clip: float = Field(
        default=0.2, gt=0.0, le=100.0, description="How far a value prediction may move from the old one (PPO)."
    )
    entropy_coef: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="Weight of the entropy bonus subtracted from the policy loss (0 = none).",
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, le=1e12, description="Gradient-norm clip per optimizer step.")
    kl_coef: float = Field(
        default=0.0, ge=0.0, le=100.0, description="Weight of KL to the reference policy (0 skips the reference model)."
    )
    kl_estimator: KLEstimator = Field(default=KLEstimator.K3, description="Estimator of KL to the reference policy.")
    kl_mode: KLMode = Field(
        default=KLMode.LOSS, description="Apply kl_coef x KL as a loss term or as a per-token reward penalty."
    )
    kl_target: float | None = Field(
        default=None,
        gt=0.0,
        le=100.0,
        description="Adaptive KL: starting from kl_coef, steer the coefficient so that the measured KL approaches this (None = fixed kl_coef).",
    )
    kl_horizon: int = Field(
        default=10000,
        ge=1,
        le=1_000_000_000,
        description="Adaptive KL: samples over which the coefficient adapts by up to 20%.",
    )
    off_policy: OffPolicy = Field(
        default=OffPolicy.BEHAVIOUR,
        description="behaviour: clip the ratio around the workers' log-probs; decoupled: clip around this update's starting "
        "policy and weight tokens by min(pi_proximal / pi_behaviour, is_cap) (one extra forward pass).",
    )
    is_cap: float = Field(
        default=2.0,
        gt=0.0,
        le=1000.0,
        description="Cap of the importance weight of stale tokens (off_policy: decoupled).",
    )
    is_level: ISLevel = Field(
        default=ISLevel.TOKEN,
        description="off_policy decoupled: truncated IS weight per token, or one per sequence (the product of its tokens' ratios).",
    )
    is_batch_normalize: bool = Field(
        default=False, description="off_policy decoupled: scale the IS weights to mean 1 over the batch."
    )
    policy_loss: PolicyLoss = Field(
        default=PolicyLoss.VANILLA,
        description="The policy loss (verl's names): vanilla PPO, gspo, cispo, clip_cov, kl_cov, gpg, geo_mean, reinforce.",
    )
    clip_cov_ratio: float = Field(
        default=0.0002, gt=0.0, le=1.0, description="clip_cov: fraction of tokens whose gradient is cut."
    )
    clip_cov_lb: float = Field(
        default=1.0, ge=-1e6, le=1e6, description="clip_cov: lower bound of the covariance of a token that may be cut."
    )
    clip_cov_ub: float = Field(
        default=5.0, ge=-1e6, le=1e6, description="clip_cov: upper bound of the covariance of a token that may be cut."
    )
    kl_cov_ratio: float = Field(
        default=0.0002,
        gt=0.0,
        le=1.0,
        description="kl_cov: fraction of tokens (highest covariance) given the KL penalty.",
    )
    ppo_kl_coef: float = Field(
        default=1.0, ge=0.0, le=100.0, description="kl_cov: weight of |log ratio| on the selected tokens."
    )
    kl_clamp: float = Field(
        default=0.0,
        ge=0.0,
        le=1000.0,
        description="Clamp k3/k3+ KL values to [-kl_clamp, kl_clamp] (verl uses 10; 0 = no clamp).",
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        le=8192,
        description="DAPO overlong reward shaping: a response longer than max_new_tokens - overlong_buffer loses up to "
        "overlong_penalty, linearly over the buffer (0 = off).",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0.0, le=100.0, description="DAPO overlong shaping: the penalty at max_new_tokens."
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO dynamic sampling: rollout workers drop groups whose rewards are all equal (counted on the run's "
        "samples_filtered, apart from samples_dropped); the batch fills with the others. Disaggregated runs only.",
    )
    shuffle: bool = Field(
        default=True,
        description="Draw each epoch's mini-batches from a fresh seeded permutation of the batch's groups (kept whole).",
    )
    seed: int = Field(
        default=0, ge=0, le=2**31 - 1, description="Seed of the mini-batch permutation (epoch e uses seed + e)."
    )

    # --- the model -----------------------------------------------------------------------------
    lora_rank: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="Train a LoRA adapter of this rank on every linear layer instead of all weights (0 = full fine-tuning); "
        "the frozen base is the KL reference.",
    )
    lora_alpha: float = Field(
        default=32.0,
        gt=0.0,
        le=10_000.0,
        description="LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_rank.",
    )
    critic: Critic = Field(
        default=Critic.SHARED,
        description="PPO critic: a value head on the policy's own (detached) hidden states, or on a separate copy of the base "
        "model that it trains too.",
    )

    # --- compute and memory --------------------------------------------------------------------
    autocast_bf16: bool = Field(
        default=False, description="Forward passes under bf16 autocast; weights and optimizer stay fp32."
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each layer's activations in the backward pass: less memory, ~30% more compute.",
    )
    logprob_chunk_tokens: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="Response tokens per LM-head chunk: bounds the fp32 (tokens x vocab) logits.",
    )
    # Padded micro-batches share through a KV cache, which gradient checkpointing drops: there
    # they run every prompt in full.
    share_prompt_prefix: bool = Field(
        default=True,
        description="Run each distinct prompt of a micro-batch once, its samples' responses attending to it (a GRPO group "
        "pays for its prompt once, forward and backward).",
    )
    pack_max_tokens: int = Field(
        default=4096,
        ge=0,
        le=1_000_000,
        description="Pack each prompt and its samples' responses (a group; several groups to a row, up to 512 tokens) into "
        "rows under a block mask when every group of a micro-batch is at most this many tokens (padding only at a row's "
        "end); longer groups run padded; 0 = always padded.",
    )

    # --- the job -------------------------------------------------------------------------------
    instance_type: str = Field(
        default="p4d.24xlarge",
        min_length=1,
        max_length=64,
        description="Catalog instance type of the training job.",
    )
    capacity: TrainingCapacity = Field(
        default=TrainingCapacity.ON_DEMAND,
        description="Capacity of the training job's node: on-demand; spot (the job checkpoints every checkpoint_every_s "
        "and at the provider's preemption notice, and a preempted job resumes from its checkpoint); or auto (spot while "
        "its expected cost, lost work and restarts counted, is below on-demand's, on-demand when no spot node comes).",
    )
    spot_zones: list[Zone] = Field(
        default_factory=list,
        max_length=16,
        description="Zones a spot training job may run in, the cheapest first: a job that gets no node within two "
        "start-ups in one is moved to the next, and a zone so given up is not tried for 2 h (auto trains on-demand once "
        "every zone is); none: any zone. On-demand jobs run in any zone.",
    )
    checkpoint_every_s: float = Field(
        default=300.0,
        ge=10.0,
        le=86_400.0,
        description="Spot training: seconds of the update between the job's checkpoints (and one at a preemption notice).",
    )
    processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Training processes in the job's pod, one per GPU of instance_type, started by torchrun; > 1 trains "
        "data-parallel with `strategy`.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Machines of instance_type one update runs on, each a pod of `processes` training processes, all "
        "one data-parallel group (nodes x processes ranks): started, billed and ended together; a lost node ends the "
        "update, which is retried as a failed or preempted job is.",
    )
    strategy: Strategy = Field(
        default=Strategy.FSDP2,
        description="Data-parallel strategy when processes x nodes > 1: torch FSDP2, or DeepSpeed ZeRO stage 1/2/3 "
        "(pip install 'spotrl[deepspeed]').",
    )
    offload_optimizer: bool = Field(
        default=False, description="ZeRO only: keep the optimizer state and its step on the CPU (DeepSpeedCPUAdam)."
    )
    max_retries: int = Field(
        default=2, ge=0, le=20, description="Times a failed training job is retried before the run fails."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.adv_estimator is not None and (self.adv_estimator == AdvantageEstimator.GAE) != (
            self.algorithm == Algorithm.PPO
        ):
            raise ValueError("gae advantages need the ppo critic, and ppo uses gae")
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 for none), got {self.dual_clip}")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef multiplicatively: give a starting kl_coef > 0")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer {self.overlong_buffer} is longer than max_new_tokens {self.max_new_tokens}"
            )
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb {self.clip_cov_lb} must be below clip_cov_ub {self.clip_cov_ub}")
        if self.offload_optimizer and self.strategy == Strategy.FSDP2:
            raise ValueError("offload_optimizer is a ZeRO option: set strategy to zero1, zero2 or zero3")
        if self.spot_zones and self.capacity == TrainingCapacity.ON_DEMAND:
            raise ValueError("spot_zones place spot training jobs: set capacity to spot or auto, or list no zones")
        if len(set(self.spot_zones)) < len(self.spot_zones):
            raise ValueError(f"spot_zones lists a zone twice: {self.spot_zones}")
        return self

    @property
    def ranks(self) -> int:
        """Training processes of one update, across its nodes: the data-parallel world size."""
        return self.processes * self.nodes

    @property
    def advantage_estimator(self) -> AdvantageEstimator:
        """The configured estimator, or the algorithm's own: GRPO's group baseline, PPO's GAE."""
        if self.adv_estimator is not None:
            return self.adv_estimator
        return AdvantageEstimator.GAE if self.algorithm == Algorithm.PPO else AdvantageEstimator.GRPO

    @property
    def effective_loss_agg(self) -> LossAggMode:
        """How token losses are aggregated: GSPO and GMPO fix their own (a mean over sequences of
        each sequence's token mean, as verl does whatever `loss_agg` says), others `loss_agg`."""
        if self.policy_loss in (PolicyLoss.GSPO, PolicyLoss.GEO_MEAN):
            return LossAggMode.SEQ_MEAN_TOKEN_MEAN
        return self.loss_agg

    @property
    def logit_temperature(self) -> float:
        """Divisor of the logits: greedy sampling (T = 0) records log-probs of the raw logits."""
        return self.temperature or 1.0
