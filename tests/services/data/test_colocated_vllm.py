"""Colocated runs sampling through vLLM (the contract-enforcing stand-in, tests/trainer_core/engines/vllm_stand_in.py):
vLLM sleeps around every update and serves the updated weights after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.data.colocated import VLLM_ADAPTERS_DIR, run_colocated
from services.domain.runspec import RunSpec
from tests.trainer_core.engines import vllm_stand_in

SPEC = {
    "model": "tiny",
    "prompts": [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}],
    "samples_per_prompt": 2,
    "batch_samples": 4,
    "iterations": 2,
    "sampling": {"max_new_tokens": 4},
    "rollout": {"engine": "vllm"},
    "training": {"instance_type": "p4d.24xlarge", "learning_rate": 1e-2},
}


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_vllm_sleeps_while_the_trainer_updates_and_then_serves_the_new_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora_rank: int
) -> None:
    vllm_stand_in.install(monkeypatch)
    spec = RunSpec.model_validate(SPEC | {"training": SPEC["training"] | {"lora_rank": lora_rank}})
    result = run_colocated(spec, out_dir=tmp_path, model_cache=tmp_path / "models", seed=3)
    assert [r.samples for r in result.iterations] == [4, 4]
    [llm] = vllm_stand_in.built
    assert llm.options["enable_sleep_mode"] and not llm.multiprocess  # in process, so tensors stay tensors
    assert llm.options["gpu_memory_utilization"] == 0.5
    # The tiny model's checkpoint is float32, which vLLM's LoRA kernels do not take.
    assert llm.options["dtype"] == ("bfloat16" if lora_rank else "float32")
    if lora_rank:
        assert llm.options["enable_lora"] and llm.options["max_lora_rank"] == 8
        # Level 1 keeps the base weights; the update is the adapter, which the second rollout
        # read from its directory (the stand-in reads its rank there).
        assert llm.calls == [("sleep", 1), ("wake_up", ["weights", "kv_cache"]), ("sleep", 1)]
        assert sorted(p.name for p in (tmp_path / VLLM_ADAPTERS_DIR).iterdir()) == ["2"]  # the one served now
    else:
        # Level 2 drops the weights that the update replaces; the new ones go in before the next rollout.
        update = [("sleep", 2), ("wake_up", ["weights"]), "reload_weights", ("reset_prefix_cache", None)]
        calls = [c if c[0] != "reload_weights" else c[0] for c in llm.calls]
        assert calls == update + [("wake_up", ["kv_cache"])] + update
        reloaded = next(names for name, names in llm.calls if name == "reload_weights")
        assert "model.embed_tokens.weight" in reloaded  # the trainer's model, by Hugging Face name


def test_a_resumed_run_hands_vllm_the_checkpointed_weights_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm_stand_in.install(monkeypatch)
    run_colocated(RunSpec.model_validate(SPEC | {"iterations": 1}), out_dir=tmp_path, model_cache=tmp_path / "models")
    run_colocated(RunSpec.model_validate(SPEC), out_dir=tmp_path, model_cache=tmp_path / "models", resume=True)
    first, resumed = vllm_stand_in.built
    assert first.calls[0] == ("sleep", 2)
    # vLLM starts from the base weights: the resumed segment serves iteration 1's before sampling.
    assert [c[0] for c in resumed.calls[:3]] == ["reload_weights", "reset_prefix_cache", "sleep"]
