from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trainer_core import memory
from trainer_core.memory import (
    MemoryMonitor,
    MicroBatchProbeError,
    available_memory_gb,
    decoder_layers,
    frozen_parameter_audit,
    is_oom_error,
    plan_micro_batch,
    probe_micro_batch,
    release_during_backward,
)
from trainer_core.models.loading import Policy


class FakeOOM(RuntimeError):
    pass


def test_plan_micro_batch_rule_of_thumb() -> None:
    # 80 GB, 1B params: 80 * 0.6 / (1 * 2 * 3) = 8
    assert plan_micro_batch(device_memory_gb=80, params_billions=1) == 8
    # 24 GB, 7B params: 14.4 / 42 < 1, floored at 1
    assert plan_micro_batch(device_memory_gb=24, params_billions=7) == 1
    assert plan_micro_batch(device_memory_gb=141, params_billions=0.5) == 28
    with pytest.raises(ValueError):
        plan_micro_batch(device_memory_gb=80, params_billions=0)


def test_available_memory_cpu() -> None:
    assert available_memory_gb(torch.device("cpu")) > 0


def test_is_oom_error() -> None:
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("boom"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))


def test_probe_halves_until_it_fits() -> None:
    tried: list[int] = []

    def step(mb: int) -> None:
        tried.append(mb)
        if mb > 5:
            raise RuntimeError("CUDA out of memory")

    assert probe_micro_batch(step, 64) == 4
    assert tried == [64, 32, 16, 8, 4]


def test_probe_custom_is_oom_and_first_try() -> None:
    def step(mb: int) -> None:
        if mb > 3:
            raise FakeOOM("nope")

    assert probe_micro_batch(step, 3, is_oom=lambda e: isinstance(e, FakeOOM)) == 3
    assert probe_micro_batch(step, 13, is_oom=lambda e: isinstance(e, FakeOOM)) == 3


def test_probe_reraises_non_oom() -> None:
    def step(mb: int) -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_micro_batch(step, 8)


def test_probe_fails_clearly_at_one() -> None:
    def step(mb: int) -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(MicroBatchProbeError, match="micro-batch size 1"):
        probe_micro_batch(step, 4)


class TinyLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_a = nn.Linear(4, 2, bias=False)
        self.lora_b = nn.Linear(2, 4, bias=False)


def test_frozen_parameter_audit() -> None:
    model = TinyLoRA()
    trainable = ["lora_a.weight", "lora_b.weight"]
    # Base left unfrozen by mistake: caught.
    assert frozen_parameter_audit(model, trainable) == ["base.weight", "base.bias"]
    model.base.requires_grad_(False)
    assert frozen_parameter_audit(model, trainable) == []
    # A frozen parameter listed as trainable is not this audit's concern.
    model.lora_b.requires_grad_(False)
    assert frozen_parameter_audit(model, iter(trainable)) == []


def test_monitor_sample_cpu() -> None:
    m = MemoryMonitor().sample()
    assert set(m) == {"perf/memory_bytes", "perf/peak_memory_bytes"}
    assert m["perf/peak_memory_bytes"] >= m["perf/memory_bytes"] > 0


def test_monitor_sees_big_allocation() -> None:
    mon = MemoryMonitor()
    before = mon.sample()
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB, touched
    after = mon.sample()
    assert after["perf/memory_bytes"] >= before["perf/memory_bytes"] + 128 * 1024**2
    assert after["perf/peak_memory_bytes"] >= after["perf/memory_bytes"]
    del big


def test_maybe_log_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    mon = MemoryMonitor(clock=lambda: now[0])
    logger = logging.getLogger("test_memory")
    with caplog.at_level(logging.INFO, logger="test_memory"):
        assert mon.maybe_log(logger, every_s=30.0)
        now[0] += 10.0
        assert not mon.maybe_log(logger, every_s=30.0)
        now[0] += 25.0
        assert mon.maybe_log(logger, every_s=30.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "test_memory"]
    assert len(lines) == 2
    assert all(line.startswith("memory: ") and "peak" in line for line in lines)


def test_decoder_layers_are_the_models_repeated_blocks(tiny_policy: Policy) -> None:
    model = tiny_policy.model
    assert decoder_layers(model) is model.model.layers
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        decoder_layers(nn.Linear(2, 2))


def test_release_during_backward_trims_at_every_nth_layer_then_unhooks(
    tiny_policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: calls.append(1))
    model = tiny_policy.model
    layers = decoder_layers(model)
    ids = torch.tensor([[1, 2, 3, 4]])

    with release_during_backward(layers, every=2):
        with torch.no_grad():  # no graph, nothing to hook
            model(input_ids=ids)
        assert calls == []
        model(input_ids=ids).logits.sum().backward()
    assert len(calls) == len(layers[::2]) > 0

    calls.clear()
    model(input_ids=ids).logits.sum().backward()
    assert calls == []
