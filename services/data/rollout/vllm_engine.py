"""The vllm engine a run spec asks for, on a rollout worker or in a colocated run."""

from __future__ import annotations

from services.domain.runspec import RunSpec
from trainer_core.engines.vllm import DEFAULT_GPU_MEMORY_UTILIZATION, VLLMEngine
from trainer_core.models.loading import Policy

# A colocated trainer keeps its weights and optimizer state on the same GPU while vLLM samples.
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5


def build_vllm_engine(spec: RunSpec, policy: Policy, *, colocated: bool = False) -> VLLMEngine:
    """vLLM serving the directory that the run's base `policy` was loaded from, in the spec's
    `rollout.vllm_dtype` (default the checkpoint's) within `rollout.vllm_gpu_memory_utilization`,
    with LoRA enabled for adapters of `training.lora_rank` when the run trains one, sharded over
    `rollout.gpus_per_worker` GPUs (tensor parallel)."""
    memory = spec.rollout.vllm_gpu_memory_utilization
    if memory is None:
        memory = COLOCATED_GPU_MEMORY_UTILIZATION if colocated else DEFAULT_GPU_MEMORY_UTILIZATION
    return VLLMEngine(
        policy.model.name_or_path,
        tokenizer=policy.tokenizer,
        dtype=spec.rollout.vllm_dtype,
        gpu_memory_utilization=memory,
        lora_rank=spec.training.lora_rank or None,
        colocated=colocated,
        tensor_parallel_size=spec.rollout.gpus_per_worker,
    )
