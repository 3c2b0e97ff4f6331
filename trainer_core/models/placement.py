"""Where a sampling model's layers live when its worker has several GPUs: spread over them,
layer by layer (what ``from_pretrained(device_map="auto")`` does, through accelerate), so that a
model larger than one GPU's memory still samples. Each layer runs on its own GPU in turn: more
memory, not more speed (vLLM's tensor parallelism gives both)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory
from transformers import PreTrainedModel


def gpu_device_map(model: PreTrainedModel, free_bytes: Sequence[int]) -> dict[str, int]:
    """Module name -> GPU index: ``model``'s layers balanced over GPUs with ``free_bytes`` free
    each, a decoder layer never split (the model's ``_no_split_modules``); ValueError where they
    do not hold it (accelerate would leave the rest in CPU memory or on disk)."""
    keep_whole = list(model._no_split_modules or [])
    budget = get_balanced_memory(model, max_memory=dict(enumerate(free_bytes)), no_split_module_classes=keep_whole)
    placed = dict(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=keep_whole))
    if not all(isinstance(device, int) for device in placed.values()):  # the rest went to "cpu" or "disk"
        raise ValueError(
            f"the model does not fit the free memory of {len(free_bytes)} GPUs: raise rollout.gpus_per_worker "
            "(on an instance type with that many GPUs), or use a smaller model"
        )
    return placed


def spread_over_gpus(model: PreTrainedModel, gpus: int) -> PreTrainedModel:
    """``model`` spread over the first ``gpus`` visible GPUs (``gpu_device_map``). A no-op for one
    GPU, and on a machine where torch sees none (CPU: the model stays where it is)."""
    if gpus <= 1 or not torch.cuda.is_available():
        return model
    visible = torch.cuda.device_count()
    if visible < gpus:
        raise ValueError(
            f"the worker asks for {gpus} GPUs (rollout.gpus_per_worker) and sees {visible}: "
            "give its pod that many GPUs, or lower rollout.gpus_per_worker"
        )
    free = [torch.cuda.mem_get_info(i)[0] for i in range(gpus)]
    return dispatch_model(model, device_map=gpu_device_map(model, free))
