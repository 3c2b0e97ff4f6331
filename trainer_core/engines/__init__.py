"""Generation engines by name, for configs and CLIs that pick one: "hf", "openai" or "vllm"."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from trainer_core.engines.hf import GenerationEngine, HFEngine
from trainer_core.engines.openai import OpenAIEngine
from trainer_core.engines.vllm import VLLMEngine


class EngineName(str, Enum):
    HF = "hf"  # HFEngine(model, tokenizer): a transformers model in this process
    OPENAI = "openai"  # OpenAIEngine(base_url, server=..., tokenizer=...): a completions server
    VLLM = "vllm"  # VLLMEngine(model_dir, tokenizer=..., ...): vLLM's offline engine, GPU only


_ENGINES: dict[EngineName, Callable[..., GenerationEngine]] = {
    EngineName.HF: HFEngine,
    EngineName.OPENAI: OpenAIEngine,
    EngineName.VLLM: VLLMEngine,
}


def make_engine(name: str, /, **options: Any) -> GenerationEngine:
    """The engine called `name`, built with `options` as its constructor's keyword arguments."""
    try:
        key = EngineName(name)
    except ValueError:
        names = ", ".join(repr(n.value) for n in EngineName)
        raise ValueError(f"unknown generation engine {name!r}: choose one of {names}") from None
    return _ENGINES[key](**options)
