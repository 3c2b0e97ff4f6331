"""A run spec's reward: its terms (built-in functions, verifiers, a reward model, the user's
function) and the reward server the scheduler may keep up for it."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from services.core.safe_regex import check_pattern
from services.domain.spec_fields import MAX_PATH_CHARS, STRICT, known_instance_type

# A user's reward function: a Python file and the name of the function in it.
_FUNCTION_REF = re.compile(r"[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*")
# Every term runs on every response: 100,000 of them took the API 20 s to validate and store.
MAX_REWARD_TERMS = 16


class RewardFn(StrEnum):
    EXACT_MATCH = "exact_match"  # 1 when the last number in the response equals the answer's
    REGEX = "regex"  # 1 when `pattern` matches the response (re.search)
    LENGTH_PENALTY = "length_penalty"  # -max(0, tokens - target_tokens) / target_tokens
    REWARD_MODEL = "reward_model"  # the score of the reward model saved at `path`
    MATH = "math"  # 1 when the response's final answer is mathematically equal to the answer (math-verify)
    CODE = "code"  # the fraction of the answer's test cases the response's program passes, in a sandbox
    FORMAT = "format"  # 1 when the response is `pattern` in full, default <think>...</think><answer>...</answer>
    FUNCTION = "function"  # the user's compute_score(data_source, solution_str, ground_truth, extra_info)


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

    _instance = field_validator("instance_type")(known_instance_type)
