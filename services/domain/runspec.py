"""The run spec: what a user asks for when submitting a run (``POST /v1/runs``).

One pydantic model family shared by the API (validation, OpenAPI), the scheduler (goals,
pool sizes) and the pods (sampling, reward, training). Every field carries a one-line doc
that the README's configuration reference and ``/docs`` both show.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from contracts.model_sources import BUILTIN_MODELS
from contracts.tensor_parallel import MAX_TENSOR_PARALLEL
from contracts.training import AdvantageEstimator, Algorithm, TrainConfig, Zone
from services.domain.prompt_items import MAX_INLINE_PROMPTS, DatasetFields, PromptItem, check_prompt_source
from services.domain.reward_spec import MAX_REWARD_TERMS, RewardFn, RewardServer, RewardTerm
from services.domain.spec_fields import MAX_PATH_CHARS, STRICT, known_instance_type
from services.ports.prices.catalog import load_catalog

# An eval metric's name: `mean`, or `pass@k` (k in the group).
_EVAL_METRIC = re.compile(r"mean|pass@([1-9][0-9]{0,2})")
# The validation context of a run trained colocated (``spotrl train --colocated``):
# ``RunSpec.model_validate(data, context=COLOCATED)`` refuses, besides, what only the
# disaggregated loop does (``RunSpec.check_colocated``).
COLOCATED: dict[str, bool] = {"colocated": True}


class CostPolicy(StrEnum):
    """How the scheduler spends (``services.control.scheduler.policies``)."""

    ALWAYS_ON = "always-on"  # on-demand training node and rollout pool, up from start to end
    THRESHOLD = "threshold"  # training launched at batch_samples and shut down after; the pool follows the backlog
    COST_AWARE = "cost-aware"  # pool sized to the trainer, warm node while cheaper than a restart, on-demand only for the deadline


class RolloutEngine(StrEnum):
    HF = "hf"  # transformers in the worker, CPU or GPU
    VLLM = "vllm"  # vLLM on the worker's GPU (pip install 'spotrl[gpu]'; untested on CPU-only machines)


class VLLMDtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


# vLLM's largest max_lora_rank (MaxLoRARanks in vllm/config/lora.py of vLLM 0.31).
VLLM_MAX_LORA_RANK = 512


class Sampling(BaseModel):
    model_config = STRICT

    temperature: float = Field(default=1.0, ge=0.0, le=5.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(default=64, ge=1, le=8192, description="Response length limit in tokens.")


class MlflowTracking(BaseModel):
    model_config = STRICT

    experiment: str = Field(
        min_length=1, max_length=256, description="MLflow experiment the run is logged under (created if missing)."
    )


class WandbTracking(BaseModel):
    model_config = STRICT

    project: str = Field(
        min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$", description="W&B project the run is logged to."
    )
    entity: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[^/\\#?%:]+$",
        description="W&B team or user owning the project; default: the API key's own.",
    )


class Tracking(BaseModel):
    """Experiment trackers that get every iteration's figures and every held-out evaluation
    (``services.control.tracking``). Where the trackers are and their credentials are the operator's settings."""

    model_config = STRICT

    tensorboard: bool = Field(
        default=False, description="Write TensorBoard event files to the object store, under runs/<run>/tensorboard/."
    )
    mlflow: MlflowTracking | None = Field(
        default=None, description="Log to the operator's MLflow server (SPOTRL_MLFLOW_TRACKING_URI)."
    )
    wandb: WandbTracking | None = Field(
        default=None, description="Log to Weights & Biases with the operator's API key (SPOTRL_WANDB_*)."
    )


class PoolOption(BaseModel):
    """Somewhere a spot rollout worker may run: an instance type, in one zone or in any."""

    model_config = STRICT

    instance_type: str = Field(min_length=1, max_length=64, description="Catalog instance type of the worker.")
    zone: Zone | None = Field(
        default=None, description="Zone its node must be in (Kubernetes' topology.kubernetes.io/zone); none: any zone."
    )

    _instance = field_validator("instance_type")(known_instance_type)


class RolloutPool(BaseModel):
    model_config = STRICT

    instance_type: str = Field(
        default="g6.xlarge", min_length=1, max_length=64, description="Catalog instance type of each rollout worker."
    )
    spot: bool = Field(default=True, description="Run rollout workers on spot capacity.")
    options: list[PoolOption] = Field(
        default_factory=list,
        max_length=16,
        description="More places spot workers may run, besides instance_type in any zone (other instance types, "
        "or zones): a new worker goes to the cheapest by spot price per hour where none waits for a node, a worker "
        "waiting for one is replaced elsewhere, and the dearest go first when the pool shrinks or capacity returns. "
        "List types that generate at about the same rate. On-demand workers and eval pods use instance_type.",
    )
    min_workers: int = Field(default=2, ge=0, le=1024, description="Workers kept while the run is active.")
    max_workers: int = Field(
        default=10, ge=1, le=1024, description="Upper bound of the pool; also the prompt topic's partition count."
    )
    prompts_per_batch: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Prompts a worker takes per poll; the pool is sized to cover the prompt backlog in such batches.",
    )
    gpus_per_worker: int = Field(
        default=1,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="GPUs each rollout worker (and eval pod) uses: vllm shards the model over them (tensor parallel: "
        "their number must divide the model's attention heads), hf spreads its layers over them (device_map auto). "
        "It must divide the GPUs of every instance type the pool may use: a node of G GPUs holds G / gpus_per_worker "
        "workers, each billed its share of the node.",
    )
    engine: RolloutEngine = Field(
        default=RolloutEngine.HF,
        description="Sampler of each worker: hf (transformers in the worker, CPU or GPU) or vllm (vLLM on the worker's GPU, "
        "pip install 'spotrl[gpu]'; untested on the CPU machines spotrl is developed on).",
    )
    vllm_dtype: VLLMDtype | None = Field(
        default=None,
        description="Weights dtype of the vllm engine: float32, bfloat16 or float16; default the checkpoint's, but "
        "bfloat16 for a float32 checkpoint when training.lora_rank is set (vLLM's LoRA kernels take float16 or "
        "bfloat16 only: float32 with LoRA is refused). vLLM's own 'auto' would serve a float32 checkpoint in bfloat16.",
    )
    vllm_gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Share of the GPU the vllm engine takes for weights and KV cache; "
        "default 0.9 on rollout workers, 0.5 in colocated runs (the trainer shares the GPU).",
    )

    _instance = field_validator("instance_type")(known_instance_type)

    @property
    def choices(self) -> list[PoolOption]:
        """Where the pool's spot workers may run: ``instance_type`` in any zone, then ``options``."""
        return [PoolOption(instance_type=self.instance_type), *self.options]

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutPool:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        return self

    @model_validator(mode="after")
    def _check_gpus_per_worker(self) -> RolloutPool:
        catalog = load_catalog()
        for where in self.choices:
            gpus = catalog.get(where.instance_type).gpus
            if gpus % self.gpus_per_worker:
                fitting = ", ".join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)
                raise ValueError(
                    f"gpus_per_worker {self.gpus_per_worker} does not divide the {gpus} GPUs of {where.instance_type}: "
                    f"set gpus_per_worker to one of {fitting}, or pick an instance type whose GPU count it divides"
                )
        return self


class EvalSpec(BaseModel):
    """Held-out evaluation: chosen policy versions scored on prompts training never sees, each by
    an eval pod on the rollout pool's instance type and capacity, beside rollout and training."""

    model_config = STRICT

    prompts: (
        Annotated[list[PromptItem], Field(max_length=MAX_INLINE_PROMPTS)]
        | Annotated[str, Field(max_length=MAX_PATH_CHARS)]
    ) = Field(
        description="The held-out prompt set, in the forms of the run's `prompts`: an inline list, a store:// upload or a "
        "JSONL path inside the server's SPOTRL_DATA_DIRS. A stored run shows `inline` for an inline list."
    )
    every_iterations: int = Field(
        default=1,
        ge=1,
        le=100_000,
        description="Evaluate every this-many-th policy version; the base model (v0) is evaluated too, as the baseline, and, "
        "when the run succeeds, its last version.",
    )
    samples_per_prompt: int = Field(default=4, ge=1, le=256, description="Responses generated per held-out prompt.")
    temperature: float = Field(
        default=1.0, ge=0.0, le=5.0, description="Sampling temperature of the eval (0 = greedy)."
    )
    max_new_tokens: int = Field(default=64, ge=1, le=8192, description="Response length limit in tokens.")
    metrics: Annotated[list[str], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: ["mean"],
        description="What to report: `mean` (mean score of every response; always reported) and `pass@k` (k <= "
        "samples_per_prompt: the chance that one of k responses to a prompt scores above 0, unbiased estimator).",
    )
    target_score: float | None = Field(
        default=None, ge=-1e6, le=1e6, description="The run ends SUCCEEDED once an eval's mean score reaches this."
    )

    @field_validator("prompts")
    @classmethod
    def _check_prompts(cls, v: list[PromptItem] | str) -> list[PromptItem] | str:
        return check_prompt_source(v, "held-out prompt")

    @model_validator(mode="after")
    def _check_metrics(self) -> EvalSpec:
        for i, name in enumerate(self.metrics):
            m = _EVAL_METRIC.fullmatch(name)
            if m is None:
                raise ValueError(
                    f"eval metrics are `mean` and `pass@k` (k a positive integer): metrics[{i}] is neither"
                )
            if m.group(1) is not None and int(m.group(1)) > self.samples_per_prompt:
                raise ValueError(f"{name} needs k <= samples_per_prompt ({self.samples_per_prompt})")
        if len(set(self.metrics)) != len(self.metrics):
            raise ValueError("each eval metric once")
        return self


class RunSpec(BaseModel):
    """What to train, on what, until when, for how much."""

    model_config = STRICT

    name: str | None = Field(default=None, max_length=64, description="Free-form label shown in listings.")
    model: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        json_schema_extra={"pattern": f"^({'|'.join(BUILTIN_MODELS)}|.*/.*|.*[.]gguf)$"},
        description="Base policy: a built-in name (tiny, smollm2-135m), or the absolute path of a HF model directory or a .gguf "
        "file inside the server's SPOTRL_DATA_DIRS.",
    )
    algorithm: Algorithm = Field(default=Algorithm.GRPO, description="RL algorithm: grpo or ppo (value head critic).")
    prompts: (
        Annotated[list[PromptItem], Field(max_length=MAX_INLINE_PROMPTS)]
        | Annotated[str, Field(max_length=MAX_PATH_CHARS)]
    ) = Field(
        description=f"Inline list of at most {MAX_INLINE_PROMPTS} {{prompt, answer}}, a prompt set uploaded with POST /v1/datasets "
        "(store://datasets/<id>.jsonl; JSONL or Parquet), or the path of a JSONL or Parquet file or of a directory written by "
        "datasets' save_to_disk inside the server's SPOTRL_DATA_DIRS. A stored run shows `inline` for an inline list, and its "
        "`prompt_count`."
    )
    dataset: DatasetFields = Field(
        default_factory=DatasetFields,
        description="The fields of a prompt set file's rows (verl's layout by default), for the run's prompts and its held-out "
        "set as read from a server path or uploaded by `spotrl runs submit`.",
    )
    reward: Annotated[list[RewardTerm], Field(min_length=1, max_length=MAX_REWARD_TERMS)] = Field(
        default_factory=lambda: [RewardTerm(fn=RewardFn.EXACT_MATCH)],
        description="Reward terms, summed with their weights.",
    )
    samples_per_prompt: int = Field(default=4, ge=1, le=256, description="Samples per prompt (the GRPO group size).")
    sampling: Sampling = Field(default_factory=Sampling, description="Sampling parameters of the rollout workers.")
    batch_samples: int = Field(
        default=5000,
        ge=1,
        le=1_000_000,
        description="Samples waiting in the queue that trigger one training iteration.",
    )
    iterations: int | None = Field(
        default=None, ge=1, le=100_000, description="Stop after this many training iterations."
    )
    target_mean_reward: float | None = Field(
        default=None, ge=-1e6, le=1e6, description="Stop once an iteration's mean reward reaches this."
    )
    rollout: RolloutPool = Field(default_factory=RolloutPool, description="The spot rollout pool.")
    training: TrainConfig = Field(
        default_factory=TrainConfig, description="The trainer's hyper-parameters and the on-demand training job."
    )
    budget_dollars: float | None = Field(
        default=None, gt=0.0, le=1e9, description="Stop (FAILED, budget exhausted) once the run has spent this much."
    )
    staleness_bound: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Samples generated by a policy more than this many versions old are dropped.",
    )
    tracking: Tracking | None = Field(
        default=None,
        description="Experiment trackers (TensorBoard, MLflow, W&B) the run's figures go to; none when absent.",
    )
    cost_policy: CostPolicy = Field(
        default=CostPolicy.COST_AWARE,
        description="How the scheduler spends: cost-aware (pool sized to the trainer, training node kept warm while cheaper than "
        "a restart, on-demand rollout only to meet the deadline), threshold (training at batch_samples, shut down after) or always-on.",
    )
    deadline_seconds: float | None = Field(
        default=None,
        gt=0.0,
        le=1e8,
        description="Wall time the run should end within; cost-aware falls back to on-demand rollout to meet it.",
    )
    eval: EvalSpec | None = Field(
        default=None, description="Held-out evaluation of chosen policy versions by eval pods (none when absent)."
    )
    reward_server: RewardServer | None = Field(
        default=None,
        description="A reward service pod (role reward) kept up for the run, serving its one reward term with a `path`; "
        "none: each rollout worker runs its reward terms itself.",
    )

    @property
    def groups_per_batch(self) -> int:
        """Prompts in one training batch, each a group of ``samples_per_prompt`` samples (a whole
        number: the spec's validation refuses a batch of partial groups)."""
        return self.batch_samples // self.samples_per_prompt

    def served_term(self) -> int | None:
        """The index of the reward term the run's reward server serves; None without one."""
        if self.reward_server is None:
            return None
        return next(i for i, t in enumerate(self.reward) if t.servable())

    def reward_terms(self, reward_url: str | None) -> list[RewardTerm]:
        """The reward terms as the rollout workers and eval pods run them: the term the reward
        server serves is scored at ``reward_url`` (where it listens now) instead of from its `path`."""
        served = self.served_term()
        if served is None or reward_url is None:
            return list(self.reward)
        terms = list(self.reward)
        terms[served] = terms[served].model_copy(update={"path": None, "url": reward_url})
        return terms

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        # The form only: whether a path is allowed and holds a model is the server's to check
        # (``services.control.api.service``), and the loaders check again.
        if v not in BUILTIN_MODELS and "/" not in v and not v.endswith(".gguf"):
            raise ValueError(
                f"give a builtin model ({', '.join(BUILTIN_MODELS)}), or the path of a model directory (with config.json) "
                "or of a .gguf file (over the API: an absolute path inside SPOTRL_DATA_DIRS)"
            )
        return v

    @classmethod
    def from_stored(cls, data: dict) -> RunSpec:
        """A spec as the state store holds it (validated when it was submitted)."""
        return cls.model_validate(data)

    @field_validator("prompts")
    @classmethod
    def _check_prompts(cls, v: list[PromptItem] | str) -> list[PromptItem] | str:
        return check_prompt_source(v, "prompt")

    @model_validator(mode="before")
    @classmethod
    def _training_of_this_run(cls, data: Any) -> Any:
        """The trainer's `algorithm`, `temperature` and `max_new_tokens` are the run's (one declaration each): they
        are put into the training section before it is validated, so its checks see them."""
        if not isinstance(data, dict):
            return data
        training = data.get("training", {})
        if isinstance(training, TrainConfig):
            training = training.model_dump()
        if not isinstance(training, dict):
            return data  # the section's own validation says what is wrong
        sampled = ("temperature", "max_new_tokens")
        for name, source in (("algorithm", "algorithm"), *((n, f"sampling.{n}") for n in sampled)):
            if name in training:
                raise ValueError(f"training.{name} is set by the run's `{source}`: give it there")
        sampling = data.get("sampling", {})
        run = {"algorithm": data.get("algorithm", cls.model_fields["algorithm"].default)}
        for name in sampled:
            default = Sampling.model_fields[name].default
            run[name] = sampling.get(name, default) if isinstance(sampling, dict) else getattr(sampling, name, default)
        return {**data, "training": {**training, **run}}

    @field_validator("training")
    @classmethod
    def _known_training_instance(cls, v: TrainConfig) -> TrainConfig:
        known_instance_type(v.instance_type)
        return v

    @model_validator(mode="after")
    def _check_vllm_lora(self) -> RunSpec:
        if self.rollout.engine == RolloutEngine.VLLM and self.training.lora_rank > VLLM_MAX_LORA_RANK:
            raise ValueError(
                f"rollout.engine vllm serves LoRA adapters of rank up to {VLLM_MAX_LORA_RANK}, not "
                f"training.lora_rank {self.training.lora_rank}: lower it, or sample with engine hf"
            )
        # vLLM's LoRA kernels assert float16 or bfloat16 weights (lora_shrink_op.py in vLLM 0.30-0.32).
        lora_on_vllm = self.rollout.engine == RolloutEngine.VLLM and self.training.lora_rank > 0
        if lora_on_vllm and self.rollout.vllm_dtype == VLLMDtype.FLOAT32:
            raise ValueError(
                "rollout.vllm_dtype float32 cannot serve LoRA adapters: vLLM's LoRA kernels take float16 or "
                "bfloat16 weights. Set rollout.vllm_dtype to bfloat16 (or float16), or leave it unset "
                "(bfloat16 for a float32 checkpoint)"
            )
        return self

    @model_validator(mode="after")
    def _one_currency(self) -> RunSpec:
        """The run's bill is in one currency: its instance types' prices must share it."""
        types = [*(o.instance_type for o in self.rollout.choices), self.training.instance_type]
        if self.reward_server is not None:
            types.append(self.reward_server.instance_type)
        load_catalog().currency_of(types)  # a ValueError if not
        return self

    @model_validator(mode="after")
    def _check_reward_server(self) -> RunSpec:
        if self.reward_server is not None:
            served = [t for t in self.reward if t.servable()]
            if len(served) != 1:
                raise ValueError(
                    f"reward_server serves one reward term with a `path` (a function or a reward model); this spec has "
                    f"{len(served)}: give exactly one, or leave reward_server out to score in the rollout workers"
                )
        return self

    @model_validator(mode="after")
    def _check_colocated_context(self, info: ValidationInfo) -> RunSpec:
        if (info.context or {}).get("colocated"):
            self.check_colocated()
        return self

    def check_colocated(self) -> RunSpec:
        """Refuse (a ValueError naming each) the settings a colocated run cannot honour; returns
        the spec. Its one process generates each batch in one pass and trains on it: it has no
        rollout side to drop uninformative groups and sample on until the batch is full (DAPO
        dynamic sampling), nor to generate a greedy response per prompt (ReMax's baseline).
        Without this, the first was ignored silently and the second failed at the first update."""
        refused = []
        if self.training.dynamic_sampling:
            refused.append(
                "training.dynamic_sampling (the rollout workers drop the groups whose rewards are all equal)"
            )
        if self.training.adv_estimator == AdvantageEstimator.REMAX:
            refused.append("training.adv_estimator remax (the rollout workers generate each prompt's greedy baseline)")
        if self.eval is not None:
            refused.append("eval (the scheduler launches the eval pods)")
        if self.rollout.gpus_per_worker > 1:
            refused.append("rollout.gpus_per_worker above 1 (the trainer and the sampler share one GPU)")
        if self.training.nodes > 1:
            refused.append("training.nodes above 1 (the scheduler launches a job's nodes)")
        if refused:
            raise ValueError(
                f"a colocated run cannot use {' or '.join(refused)}: submit the spec as a disaggregated run instead "
                "(`spotrl serve` and `spotrl scheduler`, then `spotrl runs submit SPEC_FILE` or POST /v1/runs), "
                "or leave these settings out to train colocated"
            )
        return self

    @model_validator(mode="after")
    def _check_goal(self) -> RunSpec:
        if (
            self.iterations is None
            and self.target_mean_reward is None
            and (self.eval is None or self.eval.target_score is None)
        ):
            raise ValueError(
                "set `iterations`, `target_mean_reward` or `eval.target_score` (or several), so the run can end"
            )
        if self.algorithm == Algorithm.GRPO and self.samples_per_prompt < 2:
            raise ValueError("grpo needs samples_per_prompt >= 2 (advantages are relative within a prompt's group)")
        if self.batch_samples % self.samples_per_prompt:
            raise ValueError(
                f"batch_samples ({self.batch_samples}) must be a multiple of samples_per_prompt "
                f"({self.samples_per_prompt}) so that a batch holds whole groups"
            )
        return self


def _strictly_as_json(value: Any, handler: ValidatorFunctionWrapHandler) -> RunSpec:
    """Validate a spec parsed from a client's JSON body as that JSON, in pydantic's strict mode:
    a boolean or a string is no number, a number no string, an enum is its JSON string, and an
    integer stands for a float. (Python-mode strictness would refuse an enum's string.)"""
    if not isinstance(value, dict):
        return handler(value)  # not an object: the model's own error
    return RunSpec.model_validate_json(json.dumps(value), strict=True)


# The run spec as a client sends it (``POST /v1/runs``), validated strictly. Specs read back from
# the state store and the YAML of ``spotrl train --colocated`` are validated as ``RunSpec``.
SubmittedRunSpec = Annotated[RunSpec, WrapValidator(_strictly_as_json)]
