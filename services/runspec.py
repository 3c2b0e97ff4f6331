"""The run spec: what a user asks for when submitting a run (``POST /v1/runs``).

One pydantic model family shared by the API (validation, OpenAPI), the scheduler (goals,
pool sizes) and the pods (sampling, reward, training). Every field carries a one-line doc
that the README's configuration reference and ``/docs`` both show.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from services.cost.catalog import load_catalog
from trainer_core.models import check_model_source
from trainer_core.reward_model import check_reward_model_dir


def _known_instance_type(v: str) -> str:
    load_catalog().get(v)  # raises a ValueError that lists the known types
    return v


class Algorithm(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


class PromptItem(BaseModel):
    """One line of a prompt set: ``{"prompt": ..., "answer": ...}``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="Text given to the policy.")
    answer: str | None = Field(default=None, description="Reference answer for verifiable rewards.")


class RewardTerm(BaseModel):
    """One built-in reward function and its weight; a run's reward is the weighted sum."""

    model_config = ConfigDict(extra="forbid")

    fn: Literal["exact_match", "regex", "length_penalty", "reward_model"] = Field(
        description="exact_match: 1 when the last number in the response equals the answer's; "
        "regex: 1 when `pattern` matches the response; length_penalty: -max(0, tokens - target_tokens) / target_tokens; "
        "reward_model: the score of the reward model saved at `path` for (prompt, response)."
    )
    weight: float = Field(default=1.0, description="Multiplier of this term in the sum.")
    pattern: str | None = Field(default=None, description="Regular expression (regex only); matched with re.search.")
    target_tokens: int | None = Field(default=None, gt=0, description="Length beyond which the penalty grows (length_penalty only).")
    path: str | None = Field(
        default=None, description="Directory of a reward model saved by `spotrl train-rm`, as the rollout workers see it (reward_model only)."
    )

    @model_validator(mode="after")
    def _check_args(self, info: ValidationInfo) -> RewardTerm:
        if self.fn == "regex":
            if not self.pattern:
                raise ValueError("the regex reward needs `pattern`")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"`pattern` is not a valid regular expression: {e}") from e
        if self.fn == "length_penalty" and self.target_tokens is None:
            raise ValueError("the length_penalty reward needs `target_tokens`")
        if self.fn == "reward_model":
            if not self.path:
                raise ValueError("the reward_model reward needs `path`, a directory saved by `spotrl train-rm`")
            # Checked on submission; a stored spec is re-read as it is (workers report a vanished model).
            if not (info.context or {}).get("stored"):
                check_reward_model_dir(Path(self.path))
        return self


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=5.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(default=64, ge=1, le=8192, description="Response length limit in tokens.")


class RolloutPool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_type: str = Field(default="g6.xlarge", description="Catalog instance type of each rollout worker.")
    spot: bool = Field(default=True, description="Run rollout workers on spot capacity.")
    min_workers: int = Field(default=2, ge=0, le=1000, description="Workers kept while the run is active.")
    max_workers: int = Field(default=10, ge=1, le=1000, description="Upper bound of the pool; also the prompt topic's partition count.")
    prompts_per_batch: int = Field(default=8, ge=1, le=4096, description="Prompts a worker takes per poll; the pool is sized to cover the prompt backlog in such batches.")
    engine: Literal["hf", "vllm"] = Field(
        default="hf",
        description="Sampler of each worker: hf (transformers in the worker, CPU or GPU) or vllm (vLLM on the worker's GPU, "
        "pip install 'spotrl[gpu]'; untested on the CPU machines spotrl is developed on).",
    )

    _instance = field_validator("instance_type")(_known_instance_type)

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutPool:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        return self


class Training(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_type: str = Field(default="p4d.24xlarge", description="Catalog instance type of the training job (on-demand).")
    learning_rate: float = Field(default=1e-5, gt=0.0, le=1.0, description="AdamW learning rate.")
    epochs: int = Field(default=1, ge=1, le=100, description="Passes over each batch.")
    mini_batch: int = Field(default=0, ge=0, description="Samples per optimizer step; 0 = the whole batch (one step per epoch).")
    micro_batch: int = Field(
        default=8, ge=0, le=4096,
        description="Samples per forward/backward pass (gradient accumulation); 0 = auto: the rule of thumb from the device's free memory, then on a GPU halved until a trial pass fits.",
    )
    clip_ratio: float = Field(default=0.2, gt=0.0, le=10.0, description="PPO clip range of the importance ratio.")
    kl_coef: float = Field(default=0.0, ge=0.0, description="Weight of the k3 KL-to-reference loss term (0 skips the reference model).")
    adv_estimator: Literal["", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        default="", description="Advantage estimator of a critic-free run ('' = grpo); ppo always uses gae."
    )
    autocast_bf16: bool = Field(default=False, description="Forward passes under bf16 autocast; weights and optimizer stay fp32.")
    micro_batch_tokens: int = Field(default=0, ge=0, description="Token budget of a micro-batch (padded rows x longest row); > 0 replaces micro_batch with dynamic micro-batches of similar lengths.")
    gradient_checkpointing: bool = Field(default=False, description="Recompute each layer's activations in the backward pass: less memory, ~30% more compute.")
    lora_rank: int = Field(default=0, ge=0, le=1024, description="Train a LoRA adapter of this rank on every linear layer instead of all weights (0 = full fine-tuning); the frozen base is the KL reference.")
    lora_alpha: float = Field(default=32.0, gt=0.0, description="LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_rank.")
    clip_ratio_high: float = Field(default=0.0, ge=0.0, le=10.0, description="Upper clip of the ratio, 1 + clip_ratio_high (0 = clip_ratio; DAPO's clip-higher uses 0.28).")
    dual_clip: float = Field(default=0.0, ge=0.0, description="Dual-clip bound c > 1 on negative-advantage token losses (0 = off).")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        default="token-mean", description="How token losses are averaged: over all tokens, or per sequence then over sequences."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(default="k3", description="Estimator of KL to the reference policy.")
    kl_mode: Literal["loss", "reward"] = Field(default="loss", description="Apply kl_coef x KL as a loss term or as a per-token reward penalty.")
    critic: Literal["shared", "separate"] = Field(
        default="shared",
        description="PPO critic: a value head on the policy's own (detached) hidden states, or on a separate copy of the base model that it trains too.",
    )
    kl_target: float | None = Field(
        default=None, gt=0.0, description="Adaptive KL: starting from kl_coef, steer the coefficient so that the measured KL approaches this (None = fixed kl_coef)."
    )
    kl_horizon: int = Field(default=10000, ge=1, description="Adaptive KL: samples over which the coefficient adapts by up to 20%.")
    off_policy: Literal["behaviour", "decoupled"] = Field(
        default="behaviour",
        description="behaviour: clip the ratio around the workers' log-probs; decoupled: clip around this update's "
        "starting policy and weight tokens by min(pi_proximal / pi_behaviour, is_cap) (one extra forward pass).",
    )
    is_cap: float = Field(default=2.0, gt=0.0, description="Cap of the importance weight of stale tokens (off_policy: decoupled).")
    max_retries: int = Field(default=2, ge=0, le=20, description="Times a failed training job is retried before the run fails.")
    processes: int = Field(
        default=1, ge=1, le=64,
        description="Training processes in the job's pod, one per GPU of instance_type, started by torchrun; > 1 trains data-parallel with `strategy`.",
    )
    strategy: Literal["fsdp2", "zero1", "zero2", "zero3"] = Field(
        default="fsdp2",
        description="Data-parallel strategy when processes > 1: torch FSDP2, or DeepSpeed ZeRO stage 1/2/3 (pip install 'spotrl[deepspeed]').",
    )
    offload_optimizer: bool = Field(
        default=False, description="ZeRO only: keep the optimizer state and its step on the CPU (DeepSpeedCPUAdam)."
    )

    _instance = field_validator("instance_type")(_known_instance_type)

    @model_validator(mode="after")
    def _check_kl(self) -> Training:
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef multiplicatively: give a starting kl_coef > 0")
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> Training:
        if self.offload_optimizer and not self.strategy.startswith("zero"):
            raise ValueError("offload_optimizer is a ZeRO option: set strategy to zero1, zero2 or zero3")
        return self


class RunSpec(BaseModel):
    """What to train, on what, until when, for how much."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=64, description="Free-form label shown in listings.")
    model: str = Field(description="Base policy: a local HF model directory, a .gguf file, or a built-in name (tiny, smollm2-135m).")
    algorithm: Algorithm = Field(default=Algorithm.GRPO, description="RL algorithm: grpo or ppo (value head critic).")
    prompts: list[PromptItem] | str = Field(
        description="Inline list of {prompt, answer}, a JSONL file path on the server, or an object-store URI (store://key)."
    )
    reward: Annotated[list[RewardTerm], Field(min_length=1)] = Field(
        default_factory=lambda: [RewardTerm(fn="exact_match")],
        description="Reward terms, summed with their weights.",
    )
    samples_per_prompt: int = Field(default=4, ge=1, le=256, description="Samples per prompt (the GRPO group size).")
    sampling: Sampling = Field(default_factory=Sampling, description="Sampling parameters of the rollout workers.")
    batch_samples: int = Field(default=5000, ge=1, description="Samples waiting in the queue that trigger one training iteration.")
    iterations: int | None = Field(default=None, ge=1, description="Stop after this many training iterations.")
    target_mean_reward: float | None = Field(default=None, description="Stop once an iteration's mean reward reaches this.")
    rollout: RolloutPool = Field(default_factory=RolloutPool, description="The spot rollout pool.")
    training: Training = Field(default_factory=Training, description="The on-demand training job.")
    budget_dollars: float | None = Field(default=None, gt=0.0, description="Stop (FAILED, budget exhausted) once the run has spent this much.")
    staleness_bound: int = Field(default=1, ge=0, le=100, description="Samples generated by a policy more than this many versions old are dropped.")

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str, info: ValidationInfo) -> str:
        # Checked on submission; a stored spec is re-read as it is (pods report a vanished model).
        if not (info.context or {}).get("stored"):
            check_model_source(v)
        return v

    @classmethod
    def from_stored(cls, data: dict) -> RunSpec:
        """A spec as the state store holds it (validated when it was submitted)."""
        return cls.model_validate(data, context={"stored": True})

    @field_validator("prompts")
    @classmethod
    def _check_prompts(cls, v: list[PromptItem] | str) -> list[PromptItem] | str:
        if isinstance(v, list) and not v:
            raise ValueError("at least one prompt is needed")
        if isinstance(v, str) and not v.strip():
            raise ValueError("give a JSONL path, a store:// URI or an inline list")
        return v

    @model_validator(mode="after")
    def _check_goal(self) -> RunSpec:
        if self.iterations is None and self.target_mean_reward is None:
            raise ValueError("set `iterations`, `target_mean_reward`, or both, so the run can end")
        if self.algorithm == Algorithm.GRPO and self.samples_per_prompt < 2:
            raise ValueError("grpo needs samples_per_prompt >= 2 (advantages are relative within a prompt's group)")
        if self.algorithm == Algorithm.PPO and self.training.adv_estimator:
            raise ValueError("ppo uses gae with its critic; training.adv_estimator is for grpo runs")
        if self.batch_samples % self.samples_per_prompt:
            raise ValueError(
                f"batch_samples ({self.batch_samples}) must be a multiple of samples_per_prompt "
                f"({self.samples_per_prompt}) so that a batch holds whole groups"
            )
        return self
