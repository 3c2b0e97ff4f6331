"""Whether a model shards over ``size`` GPUs by tensor parallelism as vLLM shards it, read from its
Hugging Face config.json alone (no torch): the API checks a submitted run with this, and the vllm
engine again before it builds vLLM, so that a worker fails with what to change, not in vLLM's
worker processes.

vLLM's two checks, as read in vLLM's main-branch source (not re-read in the 0.30-0.32 wheels spotrl pins):
- ``ModelConfig.verify_with_parallel_config`` (config/model.py): "Total number of attention heads
  (H) must be divisible by tensor parallel size (T)." — a ValueError when ``LLM()`` is built;
- ``QKVParallelLinear`` (model_executor/layers/linear.py): each GPU holds KV heads / T of the key
  and value heads, or, where T is at least the KV heads, one KV head replicated T / KV times;
  ``divide`` (distributed/utils.py) asserts either quotient whole ("K is not divisible by T"),
  when the workers build the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The most GPUs one rollout worker may shard its model over: one node's (8 on the largest GPU machines).
MAX_TENSOR_PARALLEL = 8
# The heads of the built-in models (contracts.model_sources.BUILTIN_MODELS), as their config.json has them.
BUILTIN_HEADS = {
    "tiny": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "smollm2-135m": {"num_attention_heads": 9, "num_key_value_heads": 3},
}


def attention_heads(config: Mapping[str, Any]) -> tuple[int, int]:
    """(attention heads, key/value heads) of a Hugging Face config (``text_config`` for a
    multimodal one); a model without grouped-query attention has as many KV heads as heads."""
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads", 0))
    kv_heads = text.get("num_key_value_heads")
    return heads, int(kv_heads) if kv_heads is not None else heads


def model_heads_config(source: str) -> Mapping[str, Any] | None:
    """What the heads of model ``source`` are read from: a built-in's, or a model directory's
    config.json; None for a .gguf file (its header is not read here) or an unreadable config."""
    if source in BUILTIN_HEADS:
        return BUILTIN_HEADS[source]
    try:
        return json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def tensor_parallel_problem(config: Mapping[str, Any], size: int) -> str | None:
    """Why vLLM cannot shard a model of this config over ``size`` GPUs; None when it can."""
    heads, kv_heads = attention_heads(config)
    if _shards(heads, kv_heads, size):
        return None
    fitting = [str(n) for n in range(1, MAX_TENSOR_PARALLEL + 1) if _shards(heads, kv_heads, n)]
    counts = f"{', '.join(fitting[:-1])} or {fitting[-1]}" if len(fitting) > 1 else fitting[0]
    what = f"{heads} attention heads" if heads % size else f"{kv_heads} key/value heads"
    return (
        f"vLLM shards the model's {what} over its GPUs, and {size} GPUs cannot split them evenly: "
        f"use {counts} GPUs per worker (rollout.gpus_per_worker), or a model whose heads they divide"
    )


def _shards(heads: int, kv_heads: int, size: int) -> bool:
    kv_split = kv_heads % size == 0 if size < kv_heads else kv_heads > 0 and size % kv_heads == 0
    return heads % size == 0 and kv_split
