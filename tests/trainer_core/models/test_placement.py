"""Spreading a sampling model over a worker's GPUs: the device map is computed here (it is
arithmetic over the model's layer sizes); the spread itself needs GPUs, and on a machine
without any (these) is a no-op."""

from __future__ import annotations

import pytest
import torch

from trainer_core.models.loading import _build_tiny
from trainer_core.models.placement import gpu_device_map, spread_over_gpus


def test_layers_are_balanced_over_the_gpus_and_none_is_split() -> None:
    model = _build_tiny().model
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    # Two GPUs of the model's size each (accelerate keeps room on the first for the largest
    # layer's activations): the layers go to both, in order.
    placed = gpu_device_map(model, [size] * 2)
    assert set(placed.values()) == {0, 1}
    devices = list(placed.values())
    assert devices == sorted(devices), "the layers run on GPU 0, then on GPU 1"
    # A decoder layer is placed whole (its _no_split_modules), never its parts apart.
    (layer_class,) = model._no_split_modules
    layers = [name for name, m in model.named_modules() if type(m).__name__ == layer_class]
    assert all(any(name == key or name.startswith(key + ".") for key in placed) for name in layers)
    # Room on one GPU: everything there; room on neither: refused, not spilled to CPU memory or disk.
    assert set(gpu_device_map(model, [10 * size, 10 * size]).values()) == {0}
    with pytest.raises(ValueError, match="does not fit the free memory of 2 GPUs: raise rollout.gpus_per_worker"):
        gpu_device_map(model, [size // 4] * 2)


def test_on_a_machine_without_gpus_the_model_stays_where_it_is() -> None:
    model = _build_tiny().model
    assert not torch.cuda.is_available()
    assert spread_over_gpus(model, 4) is model
    assert {p.device.type for p in model.parameters()} == {"cpu"}
