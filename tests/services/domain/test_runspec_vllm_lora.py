"""A run sampling LoRA versions with vLLM refuses a float32 `rollout.vllm_dtype`, which vLLM's
LoRA kernels do not take; left unset, the engine picks bfloat16 for a float32 checkpoint."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.domain.runspec import RunSpec

BASE = {"model": "tiny", "prompts": [{"prompt": "1+1=", "answer": "2"}], "iterations": 1}


def _spec(dtype: str | None, lora_rank: int, engine: str = "vllm") -> RunSpec:
    rollout = {"engine": engine, "vllm_dtype": dtype}
    return RunSpec.model_validate(BASE | {"rollout": rollout, "training": {"lora_rank": lora_rank}})


def test_float32_vllm_weights_with_lora_are_refused_saying_what_to_set() -> None:
    with pytest.raises(ValidationError, match="rollout.vllm_dtype float32 cannot serve LoRA adapters.*bfloat16"):
        _spec("float32", lora_rank=8)


@pytest.mark.parametrize(
    ("dtype", "lora_rank", "engine"),
    [(None, 8, "vllm"), ("bfloat16", 8, "vllm"), ("float16", 8, "vllm"), ("float32", 0, "vllm"), ("float32", 8, "hf")],
    ids=["unset", "bf16", "fp16", "full-weights", "hf-engine"],
)
def test_other_dtypes_full_weights_and_hf_are_accepted(dtype: str | None, lora_rank: int, engine: str) -> None:
    assert _spec(dtype, lora_rank, engine).rollout.vllm_dtype == dtype
