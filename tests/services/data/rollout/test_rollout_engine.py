"""Which sampler a rollout worker builds from its run spec, and how a vllm worker takes new versions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.core.config import Settings
from services.data.policy_store import publish_policy
from services.data.rollout.worker import RolloutWorker, StopSignal, rollout_engine
from services.domain.runspec import RunSpec
from services.ports.wiring import open_backends
from tests.trainer_core.engines import vllm_stand_in
from trainer_core.engines.hf import HFEngine
from trainer_core.models.loading import Policy, load_policy
from trainer_core.models.lora import LoraSettings, apply_lora


def _spec(**fields: object) -> RunSpec:
    return RunSpec.model_validate({"model": "tiny", "prompts": [{"prompt": "x"}], "iterations": 1} | fields)


def test_the_hf_engine_samples_from_the_policy_object_itself(tmp_path: Path) -> None:
    policy = load_policy("tiny", cache_dir=tmp_path)
    engine = rollout_engine(_spec(), policy)
    assert isinstance(engine, HFEngine) and engine._model is policy.model


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed (a GPU machine, spotrl[gpu]): this test is of the error on machines without it",
)
def test_a_vllm_worker_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    spec = _spec(rollout={"engine": "vllm"})
    with pytest.raises(ImportError, match=r"pip install 'spotrl\[gpu\]'"):
        rollout_engine(spec, load_policy(spec.model, cache_dir=tmp_path))


def test_the_run_spec_refuses_lora_ranks_vllm_cannot_serve() -> None:
    assert _spec(training={"lora_rank": 1024}).training.lora_rank == 1024  # hf samples any rank
    with pytest.raises(ValueError, match="rank up to 512, not training.lora_rank 513"):
        _spec(rollout={"engine": "vllm"}, training={"lora_rank": 513})


def test_a_vllm_worker_reloads_full_versions_from_disk_and_swaps_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm_stand_in.install(monkeypatch)
    settings = Settings(home=tmp_path, model_cache=tmp_path / "models")
    b = open_backends(settings)
    runs = {"full": {}, "lora": {"lora_rank": 4}}
    for run, training in runs.items():
        spec = _spec(rollout={"engine": "vllm", "vllm_gpu_memory_utilization": 0.6}, training=training)
        b.state.create_run(run, name=None, spec=spec.model_dump(mode="json"))
        worker = RolloutWorker(
            run_id=run,
            worker_id="w0",
            spec=spec,
            state=b.state,
            queue=b.queue,
            objects=b.objects,
            rewards=b.rewards,
            model_cache=settings.resolved_model_cache(),
            session_timeout_s=60.0,
            stop=StopSignal(1.0),
        )
        worker._load_latest_policy()
        llm = worker.engine._llm
        options = {k: llm.options.get(k) for k in ("dtype", "gpu_memory_utilization", "enable_lora", "max_lora_rank")}
        # A LoRA worker serves the float32 checkpoint in bfloat16: vLLM's LoRA kernels take no float32.
        assert options == {"dtype": "bfloat16" if training else "float32", "gpu_memory_utilization": 0.6} | (
            {"enable_lora": True, "max_lora_rank": 8} if training else {"enable_lora": None, "max_lora_rank": None}
        )
        policy = worker._policy
        trained = Policy(apply_lora(policy.model, LoraSettings(rank=4)), policy.tokenizer) if training else policy
        publish_policy(b.objects, run, 1, trained, tmp_path)
        b.state.update_run(run, policy_version=1)
        worker._load_latest_policy()
        version_dir = settings.resolved_model_cache() / "runs" / run / "v1"
        if training:
            assert worker.engine._lora_request.lora_path == str(version_dir) and not llm.calls
        else:
            assert llm.calls[0] == ("reload_weights", str(version_dir)) and llm.calls[1][0] == "reset_prefix_cache"
        completions = worker.engine.generate([[5, 6]], worker.sampling, seed=0)
        assert completions is not None and completions[0].token_ids[0] == 10
    b.close()


def test_a_worker_of_several_gpus_shards_vllm_over_them_and_hf_stays_put_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    four_gpus = {"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 4}  # 4 x A10
    training = {"instance_type": "ecs.gn7e-c16g1.32xlarge"}  # priced in the same currency
    policy = load_policy("tiny", cache_dir=tmp_path)  # 4 attention heads, 4 key/value heads
    hf = rollout_engine(_spec(rollout=four_gpus, training=training), policy)
    assert isinstance(hf, HFEngine) and {p.device.type for p in policy.model.parameters()} == {"cpu"}
    vllm_stand_in.install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # what the pod's 4 GPUs make visible
    engine = rollout_engine(_spec(rollout={**four_gpus, "engine": "vllm"}, training=training), policy)
    assert engine._llm.options["tensor_parallel_size"] == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"World size \(4\) is larger than the number of available GPUs \(2\)"):
        rollout_engine(_spec(rollout={**four_gpus, "engine": "vllm"}, training=training), policy)
