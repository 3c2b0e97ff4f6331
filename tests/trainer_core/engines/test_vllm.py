"""VLLMEngine without vLLM (no GPU here): the import, the install hint, the pure helpers on
objects shaped as vLLM's source builds them, and the engine over a stand-in `vllm`
(vllm_stand_in.py) that enforces the contracts read in vLLM 0.31.0's source. None of this shows
that vLLM itself behaves so; that needs a GPU machine. Also the engine factory, `make_engine`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.trainer_core.engines import vllm_stand_in
from trainer_core.engines import make_engine
from trainer_core.engines.hf import Completion, HFEngine, SamplingParams
from trainer_core.engines.openai import OpenAIEngine
from trainer_core.engines.vllm import VLLMEngine, completion_from_vllm, max_lora_rank_for, sampling_options
from trainer_core.models.loading import Policy
from trainer_core.models.lora import LoraSettings, apply_lora


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError


def _output(token_ids: list[int], logprobs: list[float] | None, finish_reason: str) -> SimpleNamespace:
    """A vLLM CompletionOutput: `logprobs` holds one {token_id: Logprob} mapping per step."""
    steps = None
    if logprobs is not None:
        pairs = zip(token_ids, logprobs, strict=True)
        steps = [{t: SimpleNamespace(logprob=lp, rank=1, decoded_token=None)} for t, lp in pairs]
    return SimpleNamespace(
        index=0, text="", token_ids=token_ids, logprobs=steps, finish_reason=finish_reason, stop_reason=None
    )


def test_constructing_without_vllm_says_how_to_install(no_vllm: None) -> None:
    with pytest.raises(ImportError, match=r"pip install 'spotrl\[gpu\]'"):
        VLLMEngine("some/model")


def test_sampling_options_ask_for_the_sampled_tokens_logprob() -> None:
    greedy = sampling_options(SamplingParams(temperature=0.0, max_new_tokens=8), None, [2])
    assert greedy == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "logprobs": 0,
        "stop_token_ids": [2],
        "detokenize": False,
    }
    assert sampling_options(SamplingParams(temperature=0.7), 12, [])["seed"] == 12


def test_completion_from_vllm_output() -> None:
    done = completion_from_vllm(_output([5, 6, 2], [-1.0, -0.5, -0.25], "stop"), [0, 2])
    assert done == Completion([5, 6, 2], [-1.0, -0.5, -0.25], "stop")
    # A stop token of ours that vLLM did not stop at: cut after it, as HFEngine would.
    cut = completion_from_vllm(_output([5, 0, 7], [-1.0, -0.5, -3.0], "length"), [0, 2])
    assert cut == Completion([5, 0], [-1.0, -0.5], "stop")
    assert completion_from_vllm(_output([5, 7], [-1.0, -3.0], "length"), [2]).finish_reason == "length"
    with pytest.raises(ValueError, match="no log-probs"):
        completion_from_vllm(_output([5], None, "length"), [])
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        completion_from_vllm(_output([5], [-1.0], "abort"), [])


@pytest.fixture
def stand_in_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return vllm_stand_in.install(monkeypatch)


_checkpoint, _adapter = vllm_stand_in.write_checkpoint, vllm_stand_in.write_adapter


def test_generate_keeps_order_seeds_each_request_and_aborts_on_stop(
    stand_in_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine = VLLMEngine(_checkpoint(tmp_path / "m", "float32"), stop_ids=[2], gpu_memory_utilization=0.3)
    llm = engine._llm
    assert llm.options["logprobs_mode"] == "processed_logprobs"
    assert llm.options["gpu_memory_utilization"] == 0.3
    assert llm.options["dtype"] == "float32"  # the checkpoint's, not vLLM's "auto" (bf16)
    completions = engine.generate([[1, 2], [3], [4, 5]], SamplingParams(temperature=1.0), seed=10)
    assert [c.token_ids for c in completions] == [[20, 2], [21, 2], [22, 2]]
    assert llm.intermediate_outputs == 0  # output_kind FINAL_ONLY
    assert engine.generate([[1]], SamplingParams(), should_stop=lambda: True) is None
    assert llm.calls[-1][0] == "abort" and not llm.requests
    with pytest.raises(ValueError, match="top_p=0.9"):
        engine.generate([[1]], SamplingParams(temperature=1.0, top_p=0.9))


def test_options_vllm_does_not_know_are_refused(stand_in_vllm: types.ModuleType, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m")
    assert VLLMEngine(model, dtype="float16", max_model_len=512)._llm.options["dtype"] == "float16"
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['max_lora_ranks'\\]"):
        VLLMEngine(model, max_lora_ranks=8)
    (tmp_path / "hub").mkdir()
    with pytest.raises(ValueError, match="pass dtype explicitly"):
        VLLMEngine(tmp_path / "hub")


def test_a_full_weight_push_reloads_the_checkpoint_by_path_and_resets_the_prefix_cache(
    stand_in_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine = VLLMEngine(_checkpoint(tmp_path / "base"), stop_ids=[2])
    llm = engine._llm
    assert llm.multiprocess  # vLLM's default: the engine in another process
    version = _checkpoint(tmp_path / "v1")
    llm.busy_resets = 2  # requests still hold cache blocks for two tries
    engine.load_weights_from(version)
    assert llm.calls == [("reload_weights", str(version))] + [("reset_prefix_cache", None)] * 3
    assert llm.model == str(version)
    with pytest.raises(RuntimeError, match="colocated=True, or save the weights and call load_weights_from"):
        engine.set_model(torch.nn.Linear(2, 2))
    llm.busy_resets = 10**9
    with pytest.raises(RuntimeError, match="vLLM kept its prefix cache"):
        engine._reset_prefix_cache(timeout_s=0.1)


def test_a_colocated_engine_pushes_tensors_in_process_and_sleeps(
    stand_in_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine = VLLMEngine(_checkpoint(tmp_path / "m"), colocated=True, stop_ids=[2])
    llm = engine._llm
    assert llm.options["enable_sleep_mode"] and not llm.multiprocess
    engine.set_model(torch.nn.Linear(2, 2))
    assert llm.calls == [("reload_weights", ["weight", "bias"]), ("reset_prefix_cache", None)]
    llm.calls.clear()
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="dropped the weights"):
        engine.generate([[1]], SamplingParams())
    engine.load_weights([("bias", torch.zeros(2)), ("weight", torch.zeros(2, 2))])
    engine.generate([[1]], SamplingParams(temperature=0.0))
    assert llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("reload_weights", ["bias", "weight"]),
        ("reset_prefix_cache", None),
        ("wake_up", ["kv_cache"]),
    ]
    with pytest.raises(RuntimeError, match="colocated=True"):
        VLLMEngine(tmp_path / "m").sleep()


def test_a_push_whose_names_are_not_the_models_is_refused_before_vllm_gets_it(
    stand_in_vllm: types.ModuleType, tmp_path: Path
) -> None:
    # vLLM only logs a warning for the weights a push leaves out, and serves their old values.
    engine = VLLMEngine(_checkpoint(tmp_path / "m"), colocated=True)
    llm = engine._llm
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"1 missing, e.g. \['bias'\]\. vLLM keeps serving the old values"):
        engine.load_weights([("weight", linear.weight)])
    peft_named = [(f"base_model.model.{name}", t) for name, t in linear.state_dict().items()]
    with pytest.raises(ValueError, match=r"2 missing, .*; 2 unknown, e.g. \['base_model.model.bias'"):
        engine.load_weights(peft_named)
    with pytest.raises(ValueError, match=r"1 unknown, e.g. \['extra'\]"):
        engine.load_weights([*linear.state_dict().items(), ("extra", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"the weights in .*other do not match.*1 missing, e.g. \['bias'\]"):
        engine.load_weights_from(_checkpoint(tmp_path / "other", names=("weight",)))
    assert llm.calls == []  # none of them reached vLLM
    # A tied copy (lm_head.weight of tied embeddings, which save_pretrained leaves out) is no stranger.
    engine.load_weights([*linear.state_dict().items(), ("lm_head.weight", linear.weight)])
    assert llm.calls[0] == ("reload_weights", ["weight", "bias", "lm_head.weight"])


def test_a_colocated_engine_sets_vllms_in_process_switch_only_while_building_it(
    stand_in_vllm: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path / "m")
    assert not VLLMEngine(model, colocated=True)._llm.multiprocess
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert not VLLMEngine(model, colocated=True)._llm.multiprocess
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    with pytest.raises(TypeError, match="unexpected keyword"):
        VLLMEngine(model, colocated=True, no_such_option=1)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert VLLMEngine(model)._llm.multiprocess


def test_lora_is_served_in_bfloat16_from_a_float32_checkpoint(stand_in_vllm: types.ModuleType, tmp_path: Path) -> None:
    fp32, fp16 = _checkpoint(tmp_path / "fp32", "float32"), _checkpoint(tmp_path / "fp16", "float16")
    assert VLLMEngine(fp32)._llm.options["dtype"] == "float32"  # without LoRA, the checkpoint's
    engine = VLLMEngine(fp32, lora_rank=4, stop_ids=[2])
    assert engine._llm.options["dtype"] == "bfloat16"
    engine.set_lora(_adapter(tmp_path / "v1", 4))
    assert [c.token_ids for c in engine.generate([[1]], SamplingParams(), seed=0)] == [[10, 2]]
    assert VLLMEngine(fp16, lora_rank=4)._llm.options["dtype"] == "float16"
    with pytest.raises(ValueError, match="LoRA kernels take bfloat16 or float16 weights, not float32: pass dtype="):
        VLLMEngine(fp16, lora_rank=4, dtype="float32")


def test_adapters_vllm_refuses_are_refused_when_set(
    stand_in_vllm: types.ModuleType, tmp_path: Path, tiny_policy: Policy
) -> None:
    engine = VLLMEngine(_checkpoint(tmp_path / "m"), lora_rank=8)
    refused = {
        "dora": ({"use_dora": True}, r"DoRA \(use_dora\)"),
        "saved": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        "bias": ({"bias": "lora_only"}, r"a bias \(bias\)"),
        "pattern": ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
        "pissa": ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa'"),
    }
    for name, (config, reason) in refused.items():
        with pytest.raises(ValueError, match=f"vLLM cannot serve the adapter in .*{name}: it has {reason}"):
            engine.set_lora(_adapter(tmp_path / name, 8, **config))
    with pytest.raises(ValueError, match="rank 16, above the engine's max_lora_rank 8"):
        engine.set_lora(_adapter(tmp_path / "r16", 16))
    with pytest.raises(ValueError, match="holds no PEFT adapter"):
        engine.set_lora(tmp_path / "m")
    assert engine._lora_request is None
    # What spotrl's training.lora_rank trains, as peft saves it.
    apply_lora(tiny_policy.model, LoraSettings(rank=8)).save_pretrained(tmp_path / "spotrl")
    saved = json.loads((tmp_path / "spotrl" / "adapter_config.json").read_text())
    assert (saved["bias"], saved["use_dora"], saved["modules_to_save"]) == ("none", False, None)
    engine.set_lora(tmp_path / "spotrl")
    assert engine._lora_request.lora_path == str(tmp_path / "spotrl")


def test_max_lora_rank_is_the_run_rank_rounded_up_to_one_vllm_allows() -> None:
    assert [max_lora_rank_for(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="up to 512, not 513"):
        max_lora_rank_for(513)


def test_lora_versions_sample_through_an_engine_built_for_their_rank(
    stand_in_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine = VLLMEngine(_checkpoint(tmp_path / "m"), lora_rank=12, stop_ids=[2])
    assert engine._llm.options | {"enable_lora": True, "max_lora_rank": 16} == engine._llm.options
    engine.set_lora(_adapter(tmp_path / "v1", 12))
    engine.set_lora(v2 := _adapter(tmp_path / "v2", 12))
    request = engine._lora_request
    assert (request.lora_name, request.lora_int_id, request.lora_path) == (
        "policy-2",
        2,
        str(v2),
    )  # a new id per version
    assert [c.token_ids for c in engine.generate([[1]], SamplingParams(), seed=0)] == [[10, 2]]
    with pytest.raises(RuntimeError, match="pass lora_rank"):
        VLLMEngine(tmp_path / "m").set_lora(v2)


def test_make_engine_builds_each_engine_by_name(tiny_policy: Policy, no_vllm: None) -> None:
    assert isinstance(make_engine("hf", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer), HFEngine)
    served = make_engine("openai", base_url="http://127.0.0.1:8000", server="llama.cpp")
    assert isinstance(served, OpenAIEngine) and served.server.value == "llama.cpp"
    with pytest.raises(ImportError, match="spotrl\\[gpu\\]"):
        make_engine("vllm", model="some/model")
    with pytest.raises(ValueError, match="unknown generation engine 'sglang': choose one of 'hf', 'openai', 'vllm'"):
        make_engine("sglang")


def test_modules_import_without_vllm() -> None:
    # In a fresh interpreter where `import vllm` fails, whether or not vLLM is installed here.
    code = "import sys; sys.modules['vllm'] = None; import trainer_core.engines, trainer_core.engines.vllm"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_tensor_parallel_shards_over_the_gpus_and_refuses_heads_that_do_not_split(
    tmp_path: Path, stand_in_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    llama = _checkpoint(tmp_path / "llama", "bfloat16", num_attention_heads=32, num_key_value_heads=8)
    engine = VLLMEngine(llama, stop_ids=[2], tensor_parallel_size=2)
    assert engine._llm.options["tensor_parallel_size"] == 2
    assert VLLMEngine(llama, stop_ids=[2])._llm.options["tensor_parallel_size"] == 1
    # Refused before vLLM starts its workers, saying what would split.
    smollm2 = _checkpoint(tmp_path / "smollm2", "bfloat16", num_attention_heads=9, num_key_value_heads=3)
    built = len(vllm_stand_in.built)
    with pytest.raises(
        ValueError, match=r"9 attention heads .* use 1 or 3 GPUs per worker \(rollout.gpus_per_worker\)"
    ):
        VLLMEngine(smollm2, stop_ids=[2], tensor_parallel_size=2)
    odd_kv = _checkpoint(tmp_path / "odd", "bfloat16", num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"3 key/value heads .* use 1, 3 or 6 GPUs per worker"):
        VLLMEngine(odd_kv, stop_ids=[2], tensor_parallel_size=4)
    assert len(vllm_stand_in.built) == built
