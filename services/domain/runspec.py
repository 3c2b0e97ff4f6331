"""The run spec: what a user asks for when submitting a run (``POST /v1/runs``).

One pydantic model family shared by the API (validation, OpenAPI), the scheduler (goals,
pool sizes) and the pods (sampling, reward, training). Every field carries a one-line doc
that the README's configuration reference and ``/docs`` both show.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from contracts.messages import PromptMessage
from contracts.model_sources import BUILTIN_MODELS
from contracts.status import RunStatus
from contracts.training import AdvantageEstimator, Algorithm, TrainConfig
from services.core.safe_regex import check_pattern
from services.ports.prices.catalog import load_catalog

MAX_INLINE_PROMPTS = 10_000
# An eval metric's name: `mean`, or `pass@k` (k in the group).
_EVAL_METRIC = re.compile(r"mean|pass@([1-9][0-9]{0,2})")
# A user's reward function: a Python file and the name of the function in it.
_FUNCTION_REF = re.compile(r"[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*")
MAX_PATH_CHARS = 1024
# Every term runs on every response: 100,000 of them took the API 20 s to validate and store.
MAX_REWARD_TERMS = 16
# Every model of the spec: numbers are finite (no NaN or infinity), unknown fields are refused.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
# The validation context of a run trained colocated (``spotrl train --colocated``):
# ``RunSpec.model_validate(data, context=COLOCATED)`` refuses, besides, what only the
# disaggregated loop does (``RunSpec.check_colocated``).
COLOCATED: dict[str, bool] = {"colocated": True}


def _known_instance_type(v: str) -> str:
    load_catalog().get(v)  # raises a ValueError that lists the known types
    return v


class RewardFn(StrEnum):
    EXACT_MATCH = "exact_match"  # 1 when the last number in the response equals the answer's
    REGEX = "regex"  # 1 when `pattern` matches the response (re.search)
    LENGTH_PENALTY = "length_penalty"  # -max(0, tokens - target_tokens) / target_tokens
    REWARD_MODEL = "reward_model"  # the score of the reward model saved at `path`
    MATH = "math"  # 1 when the response's final answer is mathematically equal to the answer (math-verify)
    CODE = "code"  # the fraction of the answer's test cases the response's program passes, in a sandbox
    FORMAT = "format"  # 1 when the response is `pattern` in full, default <think>...</think><answer>...</answer>
    FUNCTION = "function"  # the user's compute_score(data_source, solution_str, ground_truth, extra_info)


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


# The JSON a prompt item carries for its reward beyond the text (`answer`, `extra_info`), as
# serialised: a code task's test cases fit; a line of a prompt set holds at most MAX_LINE_CHARS.
MAX_REWARD_DATA_CHARS = 200_000
MAX_PROMPT_CHARS = 100_000


def check_prompt_source(v: list[PromptItem] | str, what: str) -> list[PromptItem] | str:
    """A spec's prompt set as given: a non-empty inline list, or a path or store:// URI."""
    if isinstance(v, list) and not v:
        raise ValueError(f"at least one {what} is needed")
    if isinstance(v, str) and not v.strip():
        raise ValueError("give a JSONL path, a store:// URI or an inline list")
    return v


class ChatMessage(BaseModel):
    """One turn of a chat prompt, as verl's datasets and OpenAI's API write it."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: str = Field(max_length=MAX_PROMPT_CHARS, description="What is said.")


def _bounded_json(value: JsonValue, field: str) -> JsonValue:
    if value is not None and len(json.dumps(value)) > MAX_REWARD_DATA_CHARS:
        raise ValueError(f"{field} is longer than {MAX_REWARD_DATA_CHARS} characters as JSON")
    return value


class PromptItem(BaseModel):
    """One prompt of a prompt set: its text or chat messages, and what its reward reads."""

    model_config = STRICT

    prompt: str | Annotated[list[ChatMessage], Field(min_length=1, max_length=64)] = Field(
        description="Text given to the policy as a user turn, or chat messages rendered with the model's chat template."
    )
    answer: JsonValue = Field(
        default=None,
        description="Reference answer (verl's reward_model.ground_truth): text, or any JSON value the reward reads, such as a "
        "code task's test cases.",
    )
    data_source: str | None = Field(
        default=None, max_length=256, description="Which dataset the item comes from; passed to the reward."
    )
    extra_info: dict[str, JsonValue] | None = Field(
        default=None, description="Anything else the reward reads (verl's extra_info)."
    )

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: str | list[ChatMessage]) -> str | list[ChatMessage]:
        chars = len(v) if isinstance(v, str) else sum(len(m.content) for m in v)
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return v

    def message(self, prompt_id: str) -> PromptMessage:
        """The item as queued for the rollout workers (``<run>.prompts``)."""
        return PromptMessage(prompt_id=prompt_id, **self.model_dump(mode="json"))

    @field_validator("answer")
    @classmethod
    def _check_answer(cls, v: JsonValue) -> JsonValue:
        return _bounded_json(v, "answer")

    @field_validator("extra_info")
    @classmethod
    def _check_extra_info(cls, v: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        return _bounded_json(v, "extra_info")  # type: ignore[return-value]


def cycled_messages(items: Sequence[PromptItem], start: int, count: int) -> list[PromptMessage]:
    """Prompts ``start`` to ``start + count`` of a run, as queued for rollout: a run goes over its
    prompt set again and again (epochs) until it ends, so prompt ``i`` is item ``i % len(items)``,
    with that index as its prompt id (the same prompt has the same id in every epoch). The
    scheduler publishes them so and a colocated run takes its batches so, so that both train on
    the same prompts in the same order."""
    return [items[i % len(items)].message(str(i % len(items))) for i in range(start, start + count)]


class RewardTerm(BaseModel):
    """One built-in reward function and its weight; a run's reward is the weighted sum."""

    model_config = STRICT

    fn: RewardFn = Field(
        description="exact_match: 1 when the last number in the response equals the answer's; "
        "regex: 1 when `pattern` matches the response; length_penalty: -max(0, tokens - target_tokens) / target_tokens; "
        "reward_model: the score of the reward model saved at `path` for (prompt, response); "
        "math: 1 when the response's final answer (e.g. \\boxed{}) is mathematically equal to the answer (math-verify); "
        "code: the fraction of the test cases in the answer that the response's program passes, run in a sandbox; "
        "format: 1 when the response is `pattern` in full (default <think>...</think> then <answer>...</answer>); "
        "function: the user's verl-style compute_score(data_source, solution_str, ground_truth, extra_info) in `path` "
        "(file.py:name) or served at `url` (`spotrl reward-server --function`)."
    )
    weight: float = Field(default=1.0, ge=-1e6, le=1e6, description="Multiplier of this term in the sum.")
    pattern: str | None = Field(
        default=None,
        max_length=1000,
        description="Regular expression: regex matches it with re.search; format, in full.",
    )
    target_tokens: int | None = Field(
        default=None, gt=0, le=1_000_000, description="Length beyond which the penalty grows (length_penalty only)."
    )
    path: str | None = Field(
        default=None,
        max_length=MAX_PATH_CHARS,
        description="reward_model: the directory of a reward model saved by `spotrl train-rm`; function: `file.py:name`, the "
        "Python file and function; both as the rollout workers see them (over the API, inside SPOTRL_DATA_DIRS).",
    )
    url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="Instead of `path`: the URL of a reward service (`spotrl reward-server`) the rollout workers reach; over the "
        "API, one the operator allows (SPOTRL_REWARD_SERVICE_URLS) (reward_model and function).",
    )
    quantize: Literal["4bit", "8bit"] | None = Field(
        default=None,
        description="reward_model with `path`: load its backbone's Linear layers in 8 bits to use less memory (4bit, for CUDA, is refused: rollout workers load reward models on the CPU).",
    )

    def servable(self) -> bool:
        """Whether a run's reward server can serve this term: a function or reward model at a `path`."""
        return self.path is not None and self.fn in (RewardFn.FUNCTION, RewardFn.REWARD_MODEL)

    @model_validator(mode="after")
    def _check_args(self) -> RewardTerm:
        if self.fn == RewardFn.REGEX:
            if not self.pattern:
                raise ValueError("the regex reward needs `pattern`")
            check_pattern(self.pattern)
        if self.fn == RewardFn.LENGTH_PENALTY and self.target_tokens is None:
            raise ValueError("the length_penalty reward needs `target_tokens`")
        if self.fn == RewardFn.FORMAT and self.pattern:
            check_pattern(self.pattern)
        if self.fn == RewardFn.REWARD_MODEL and (self.path is None) == (self.url is None):
            raise ValueError(
                "the reward_model reward needs `path`, a directory saved by `spotrl train-rm`, or `url`, a reward service (one of the two)"
            )
        if self.quantize is not None and (self.fn != RewardFn.REWARD_MODEL or self.path is None):
            raise ValueError(
                "`quantize` is for the reward_model reward with `path` (a reward service is quantized by `spotrl reward-server --quantize`)"
            )
        if self.quantize == "4bit":
            raise ValueError(
                "`quantize: 4bit` needs a CUDA GPU, and rollout workers load reward models on the CPU: use 8bit"
            )
        if self.fn == RewardFn.FUNCTION:
            if (self.path is None) == (self.url is None):
                raise ValueError(
                    "the function reward needs `path`, the Python file and function as file.py:compute_score, or `url`, "
                    "a reward service started with `spotrl reward-server --function` (one of the two)"
                )
            if self.path is not None and not _FUNCTION_REF.fullmatch(self.path):
                raise ValueError(
                    "the function reward's `path` is file.py:name, e.g. /data/rewards/gsm8k.py:compute_score"
                )
        return self


class RewardServer(BaseModel):
    """A reward service pod the scheduler keeps up for the run: it serves the one reward term
    with a `path` (a user's function or a reward model) to the rollout workers and eval pods."""

    model_config = STRICT

    instance_type: str = Field(
        default="g4dn.xlarge",
        min_length=1,
        max_length=64,
        description="Catalog instance type of the pod (a small GPU: T4/L4 class).",
    )
    spot: bool = Field(
        default=False,
        description="Run it on spot capacity (a preempted pod is started again; scoring waits meanwhile).",
    )

    _instance = field_validator("instance_type")(_known_instance_type)


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


class RolloutPool(BaseModel):
    model_config = STRICT

    instance_type: str = Field(
        default="g6.xlarge", min_length=1, max_length=64, description="Catalog instance type of each rollout worker."
    )
    spot: bool = Field(default=True, description="Run rollout workers on spot capacity.")
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
    engine: RolloutEngine = Field(
        default=RolloutEngine.HF,
        description="Sampler of each worker: hf (transformers in the worker, CPU or GPU) or vllm (vLLM on the worker's GPU, "
        "pip install 'spotrl[gpu]'; untested on the CPU machines spotrl is developed on).",
    )
    vllm_dtype: VLLMDtype | None = Field(
        default=None,
        description="Weights dtype of the vllm engine: float32, bfloat16 or float16; default the checkpoint's "
        "(vLLM's own 'auto' would serve a float32 checkpoint in bfloat16).",
    )
    vllm_gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Share of the GPU the vllm engine takes for weights and KV cache; "
        "default 0.9 on rollout workers, 0.5 in colocated runs (the trainer shares the GPU).",
    )

    _instance = field_validator("instance_type")(_known_instance_type)

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutPool:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
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


class DatasetFields(BaseModel):
    """Where each row of a prompt set file keeps what a prompt item needs (verl's ``data.prompt_key``
    and ``reward_model.ground_truth``). Every other field of a row reaches the reward in its
    ``extra_info``; a row's own ``extra_info`` object is merged in and wins."""

    model_config = STRICT

    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        max_length=256,
        description="The field holding each row's prompt: text or chat messages.",
    )
    answer_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[^.]+(\.[^.]+)*$",
        description="The dotted path of each row's answer, e.g. reward_model.ground_truth; by default reward_model.ground_truth "
        "where a row has it, else `answer`. The top-level field it lies in is not passed on in extra_info.",
    )


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
        _known_instance_type(v.instance_type)
        return v

    @model_validator(mode="after")
    def _check_vllm_lora(self) -> RunSpec:
        if self.rollout.engine == RolloutEngine.VLLM and self.training.lora_rank > VLLM_MAX_LORA_RANK:
            raise ValueError(
                f"rollout.engine vllm serves LoRA adapters of rank up to {VLLM_MAX_LORA_RANK}, not "
                f"training.lora_rank {self.training.lora_rank}: lower it, or sample with engine hf"
            )
        return self

    @model_validator(mode="after")
    def _one_currency(self) -> RunSpec:
        """The run's bill is in one currency: its instance types' prices must share it."""
        types = [self.rollout.instance_type, self.training.instance_type]
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


@dataclass(frozen=True)
class RunEnd:
    """Why a run is done: the spec field that ended it, the status it ends with, and the reason shown."""

    goal: Literal["iterations", "target_mean_reward", "eval.target_score", "budget_dollars"]
    status: RunStatus
    reason: str


def run_end(
    spec: RunSpec,
    *,
    iterations_done: int,
    last_mean_reward: float | None,
    spent_dollars: float,
    best_eval: tuple[int, float] | None = None,
) -> RunEnd | None:
    """The end a run has reached, or None while it goes on: the scheduler and a colocated run
    both ask this, so the two modes end a run alike. Its goals come first: a run whose last
    iteration reached a goal succeeded, even if that iteration spent the rest of the budget;
    the budget fails only a run still short of every goal. `best_eval` is (policy version,
    mean score) of the best recorded eval."""
    if spec.iterations is not None and iterations_done >= spec.iterations:
        return RunEnd("iterations", RunStatus.SUCCEEDED, f"trained {iterations_done} iterations")
    target = spec.target_mean_reward
    if target is not None and last_mean_reward is not None and last_mean_reward >= target:
        return RunEnd(
            "target_mean_reward", RunStatus.SUCCEEDED, f"mean reward {last_mean_reward:.3f} reached the target {target}"
        )
    target = spec.eval.target_score if spec.eval is not None else None
    if target is not None and best_eval is not None and best_eval[1] >= target:
        version, score = best_eval
        return RunEnd(
            "eval.target_score",
            RunStatus.SUCCEEDED,
            f"eval mean score {score:.3f} of policy v{version} reached the target {target}",
        )
    if spec.budget_dollars is not None and spent_dollars >= spec.budget_dollars:
        return RunEnd(
            "budget_dollars",
            RunStatus.FAILED,
            f"budget exhausted: spent ${spent_dollars:.2f} of ${spec.budget_dollars:.2f} "
            f"after {iterations_done} iterations (policy v{iterations_done} is published)",
        )
    return None


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
