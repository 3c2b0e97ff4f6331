"""The stand-in `vllm` (vllm_stand_in.py) itself. First, each contract of vLLM 0.31.0 that it
enforces fires, so that the engine's tests passing against it keep meaning something. Then the
calls that spotrl made before its vLLM engine was checked against vLLM's source (VLLMEngine
before commit 9b16e2f, the rollout worker before c9ee3ce), replayed as they were: they fail
against the stand-in wherever vLLM would fail them. What these tests cannot show is that vLLM
itself behaves so; bench/vllm_gpu.py is the check for a GPU machine."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_core.engines import vllm_stand_in
from tests.trainer_core.engines.vllm_stand_in import (
    LLM,
    LoRARequest,
    RequestOutputKind,
    SamplingParams,
    TokensPrompt,
    write_adapter,
    write_checkpoint,
)


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in as `import vllm` gives it, with vLLM's environment switches unset."""
    return vllm_stand_in.install(monkeypatch)


@pytest.fixture
def model(vllm: types.ModuleType, tmp_path: Path) -> str:
    """A model directory as vLLM reads it."""
    return str(write_checkpoint(tmp_path / "base"))


def _prompt() -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=[1, 2])


def test_llm_takes_only_vllms_own_options_and_values(model: str) -> None:
    # Every option spotrl's engine and bench/vllm_gpu.py pass is one of LLM's or EngineArgs'.
    assert {
        "dtype",
        "gpu_memory_utilization",
        "logprobs_mode",
        "enable_sleep_mode",
        "enable_lora",
        "max_lora_rank",
        "max_model_len",
        "enforce_eager",
    } <= vllm_stand_in.LLM_OPTIONS
    LLM(model, dtype="float32", enable_lora=True, max_lora_rank=320, gpu_memory_utilization=1.0, enforce_eager=True)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['max_lora_ranks'\]"):
        LLM(model, max_lora_ranks=8)
    with pytest.raises(ValueError, match="dtype 'fp32' is not one of"):
        LLM(model, dtype="fp32")
    for rank in (0, 2, 4, 12, 1024):  # MaxLoRARanks: 1, 8, 16, 32, 64, 128, 256, 320, 512
        with pytest.raises(ValueError, match=f"max_lora_rank {rank} is not one of"):
            LLM(model, enable_lora=True, max_lora_rank=rank)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            LLM(model, gpu_memory_utilization=share)


def test_a_lora_request_needs_lora_enabled_and_an_adapter_within_max_lora_rank(model: str, tmp_path: Path) -> None:
    rank_16, rank_32 = write_adapter(tmp_path / "r16", 16), write_adapter(tmp_path / "r32", 32)
    with pytest.raises(ValueError, match="but LoRA is not enabled!"):
        LLM(model).add_request("a", _prompt(), SamplingParams(), lora_request=LoRARequest("v1", 1, str(rank_16)))
    default = LLM(model, enable_lora=True)  # max_lora_rank 16, vLLM's default
    default.add_request("a", _prompt(), SamplingParams(), lora_request=LoRARequest("v1", 1, str(rank_16)))
    with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        default.add_request("b", _prompt(), SamplingParams(), lora_request=LoRARequest("v2", 2, str(rank_32)))
    assert list(default.requests) == ["a"]
    LLM(model, enable_lora=True, max_lora_rank=32).add_request(
        "b", _prompt(), SamplingParams(), lora_request=LoRARequest("v2", 2, str(rank_32))
    )
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("v0", 0, str(rank_16))


def test_adapters_with_what_vllms_peft_helper_refuses_are_refused(model: str, tmp_path: Path) -> None:
    llm = LLM(model, enable_lora=True, max_lora_rank=8)
    refused = {
        "saved": ({"modules_to_save": ["lm_head", "score"]}, r"Unsupported modules_to_save: \['lm_head'\]"),
        "dora": ({"use_dora": True}, "vLLM does not yet support DoRA."),
        "bias": ({"bias": "all"}, "Adapter bias is not supported."),
    }
    for i, (name, (config, message)) in enumerate(refused.items(), start=1):
        adapter = LoRARequest(name, i, str(write_adapter(tmp_path / name, 8, **config)))
        with pytest.raises(ValueError, match=message):
            llm.add_request(name, _prompt(), SamplingParams(), lora_request=adapter)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "adapter_config.json").write_text('{"r": 8}')
    with pytest.raises(ValueError, match="Missing required configuration fields"):
        llm.add_request(
            "bare", _prompt(), SamplingParams(), lora_request=LoRARequest("bare", 4, str(tmp_path / "bare"))
        )
    assert not llm.requests
    classifier = write_adapter(tmp_path / "classifier", 8, modules_to_save=["classifier"])
    llm.add_request("c", _prompt(), SamplingParams(), lora_request=LoRARequest("c", 5, str(classifier)))


def test_a_lora_request_on_float32_weights_fails_vllms_lora_kernel(tmp_path: Path, vllm: types.ModuleType) -> None:
    fp32 = str(write_checkpoint(tmp_path / "fp32", "float32"))
    adapter = LoRARequest("v1", 1, str(write_adapter(tmp_path / "v1", 8)))
    llm = LLM(fp32, dtype="float32", enable_lora=True, max_lora_rank=8)
    llm.add_request("base", _prompt(), SamplingParams())
    llm.step()  # no adapter: the kernel returns before its assert
    llm.add_request("a", _prompt(), SamplingParams(), lora_request=adapter)
    with pytest.raises(AssertionError, match="float16 or bfloat16 inputs, not float32"):
        llm.step()
    auto = LLM(fp32, enable_lora=True, max_lora_rank=8)  # "auto": a float32 checkpoint in bfloat16
    assert auto.dtype == "bfloat16"
    auto.add_request("a", _prompt(), SamplingParams(), lora_request=adapter)
    auto.step()


def test_sleep_needs_sleep_mode_and_a_sleeping_engine_does_no_work(model: str) -> None:
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        LLM(model).sleep(level=1)
    llm = LLM(model, enable_sleep_mode=True)
    llm.sleep(level=2)
    llm.add_request("a", _prompt(), SamplingParams())  # queued while paused
    with pytest.raises(RuntimeError, match="step while paused, asleep .*a generate loop would never end"):
        llm.step()
    with pytest.raises(RuntimeError, match="reload_weights while the weights sleep"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
    with pytest.raises(RuntimeError, match="Executor is already sleeping"):
        llm.sleep(level=1)
    with pytest.raises(ValueError, match="wake_up tags must be in"):
        llm.wake_up(tags=["weight"])
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
    with pytest.raises(RuntimeError, match=r"step while paused, asleep \(\['kv_cache'\]\)"):
        llm.step()
    # A tag awake already: vLLM wakes none of them, kv_cache included.
    with pytest.raises(RuntimeError, match="Tag weights is not in sleeping tags' and wakes none of them"):
        llm.wake_up(tags=["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="Executor is already sleeping"):  # kv_cache sleeps still
        llm.sleep(level=1)
    llm.wake_up()
    assert [o.finished for o in llm.step()] == [False]  # CUMULATIVE: unfinished requests come out too
    assert llm.intermediate_outputs == 1


def test_sleep_aborts_the_requests_in_flight(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Across processes their outputs come back finished "abort".
    llm = LLM(model, enable_sleep_mode=True)
    llm.add_request("a", _prompt(), SamplingParams(seed=1))
    llm.step()
    llm.sleep(level=1)
    llm.wake_up()
    [aborted] = llm.step()
    assert aborted.request_id == "a" and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == [11] and not llm.has_unfinished_requests()
    # In process nothing reports them: a loop waiting for them would never end, until it aborts them.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    local = LLM(model, enable_sleep_mode=True)
    local.add_request("a", _prompt(), SamplingParams())
    local.sleep(level=1)
    local.wake_up()
    assert local.has_unfinished_requests()
    with pytest.raises(RuntimeError, match=r"requests \['a'\] were aborted by sleep in process"):
        local.step()
    local.abort_request(["a"])
    assert not local.has_unfinished_requests()


def test_collective_rpc_arguments_cross_into_the_engine_process_by_msgpack(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(model)
    assert llm.multiprocess  # VLLM_ENABLE_V1_MULTIPROCESSING unset: vLLM's default
    version = write_checkpoint(tmp_path / "v1")
    assert llm.collective_rpc("reload_weights", kwargs={"weights_path": str(version)}) == [None]  # a path crosses
    assert llm.model == str(version)
    with pytest.raises(RuntimeError, match="Cannot find any model weights"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)})
    with pytest.raises(TypeError, match="is not serializableSet VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        llm.collective_rpc(lambda worker: None)
    with pytest.raises(TypeError, match="<class 'object'> is not serializable"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": object()})
    # A tensor crosses, but as a plain [dtype, shape, data] list.
    with pytest.raises(AttributeError, match=r"arrived as list \['float32', \[3\], 0\]"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [("w", torch.zeros(3))]})
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    assert llm.collective_rpc(lambda worker, x: x + 1, args=(1,)) == [2]  # cloudpickled
    with pytest.raises(TypeError, match="generator"):  # pickle cannot take an iterator of tensors
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (w for w in [("w", torch.zeros(3))])})
    # In process (VLLM_ENABLE_V1_MULTIPROCESSING=0 before LLM()), the call is direct.
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    local = LLM(model)
    assert not local.multiprocess
    weights = list(torch.nn.Linear(2, 2).state_dict().items())
    local.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    assert local.calls == [("reload_weights", ["weight", "bias"])]


def test_weights_are_loaded_by_the_models_names(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model)
    linear = torch.nn.Linear(2, 2)
    # vLLM only warns of a weight left out, and serves its old value: the stand-in raises.
    with pytest.raises(RuntimeError, match=r"not loaded from checkpoint: \['bias'\] \(vLLM only warns"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([("weight", linear.weight)])})
    with pytest.raises(RuntimeError, match=r"not loaded from checkpoint: \['bias'\]"):
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(write_checkpoint(tmp_path / "v1", names=("weight",)))}
        )
    with pytest.raises(ValueError, match="There is no module or parameter named 'base_model'"):
        peft_named = [(f"base_model.model.{n}", t) for n, t in linear.state_dict().items()]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(peft_named)})
    assert llm.calls == []
    # A tied copy of a weight it loads is skipped (lm_head.weight of tied embeddings).
    tied = [*linear.state_dict().items(), ("lm_head.weight", linear.weight)]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tied)})
    with pytest.raises(ValueError, match="There is no module or parameter named 'lm_head'"):
        untied = [*linear.state_dict().items(), ("lm_head.weight", torch.zeros(2, 2))]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(untied)})


def test_reset_prefix_cache_answers_false_while_requests_hold_the_cache(model: str) -> None:
    llm = LLM(model)
    assert llm.reset_prefix_cache() is True
    llm.add_request("a", _prompt(), SamplingParams(seed=3, output_kind=RequestOutputKind.FINAL_ONLY))
    assert llm.reset_prefix_cache() is False
    assert llm.step() == []  # FINAL_ONLY: nothing until the request finishes
    [done] = llm.step()
    assert done.finished and done.outputs[0].token_ids == [13, 2]
    assert llm.reset_prefix_cache() is True


def test_requests_take_token_prompts_and_sampling_params_own_fields(model: str) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['max_new_tokens'\]"):
        SamplingParams(max_new_tokens=8)  # HF's name; vLLM's is max_tokens
    llm = LLM(model)
    with pytest.raises(TypeError, match="is not a TokensPrompt"):
        llm.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(TypeError, match="prompt_token_ids must be ints"):
        tensor_ids = TokensPrompt(prompt_token_ids=[torch.tensor(1)])  # type: ignore[list-item]
        llm.add_request("a", tensor_ids, SamplingParams())
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.add_request("a", _prompt(), {"max_tokens": 8})


# The calls spotrl made before its vLLM engine was checked against vLLM's source.


def _earlier_engine_llm(
    vllm: types.ModuleType, model: str, *, colocated: bool = False, max_lora_rank: int | None = None
) -> Any:
    """`vllm.LLM` as VLLMEngine built it before 9b16e2f: LoRA only when given `max_lora_rank`,
    taken as it came; no dtype (vLLM's "auto") and vLLM's default GPU share."""
    lora = {"enable_lora": True, "max_lora_rank": max_lora_rank} if max_lora_rank else {}
    return vllm.LLM(model=model, logprobs_mode="processed_logprobs", enable_sleep_mode=colocated, **lora)


def _earlier_add_request(vllm: types.ModuleType, llm: Any, lora_request: Any = None) -> None:
    """A request as the earlier `VLLMEngine.generate` added it."""
    options = {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "logprobs": 0,
        "stop_token_ids": [2],
        "detokenize": False,
    }
    params = vllm.SamplingParams(**options)
    llm.llm_engine.add_request("spotrl-0", {"prompt_token_ids": [1, 2]}, params, lora_request=lora_request)


def test_the_earlier_rollout_worker_could_not_sample_a_lora_version(
    vllm: types.ModuleType, model: str, tmp_path: Path
) -> None:
    # The worker built its engine with make_engine("vllm", model=..., tokenizer=...): no LoRA.
    llm = _earlier_engine_llm(vllm, model)
    _earlier_add_request(vllm, llm)  # the base version samples
    adapter = write_adapter(tmp_path / "v1", 4)
    with pytest.raises(ValueError, match="LoRA is not enabled!"):  # every adapter version after it
        _earlier_add_request(vllm, llm, vllm_stand_in.LoRARequest("policy-1", 1, str(adapter)))


def test_the_earlier_engine_took_the_runs_lora_rank_as_max_lora_rank(vllm: types.ModuleType, model: str) -> None:
    for run_rank in (4, 12):  # not ranks vLLM allows as max_lora_rank
        with pytest.raises(ValueError, match=f"max_lora_rank {run_rank} is not one of"):
            _earlier_engine_llm(vllm, model, max_lora_rank=run_rank)


def test_the_earlier_full_weight_push_did_not_cross_into_vllms_engine_process(
    vllm: types.ModuleType, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _earlier_engine_llm(vllm, model)

    def _load_weights_on_worker(worker: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        worker.model_runner.model.load_weights(weights=named_tensors)  # as the earlier module's

    weights = list(torch.nn.Linear(2, 2).state_dict().items())
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        llm.collective_rpc(_load_weights_on_worker, args=(weights,))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with pytest.raises(AttributeError, match=r"weight weight arrived as list \['float32', \[2, 2\], 0\]"):
        llm.collective_rpc(_load_weights_on_worker, args=(weights,))


def test_the_earlier_engine_served_lora_versions_of_a_float32_checkpoint_in_float32(
    vllm: types.ModuleType, tmp_path: Path
) -> None:
    # It passed dtype=dtype or checkpoint_dtype(model): float32 for the tiny model and SmolLM2 (from
    # GGUF) when rollout.vllm_dtype was unset, so every LoRA version after the base failed.
    fp32 = str(write_checkpoint(tmp_path / "fp32", "float32"))
    llm = vllm.LLM(model=fp32, dtype="float32", logprobs_mode="processed_logprobs", enable_lora=True, max_lora_rank=8)
    _earlier_add_request(vllm, llm)
    assert [o.finished for o in llm.step() + llm.step()] == [False, True]  # the base version samples
    adapter = write_adapter(tmp_path / "v1", 4)
    _earlier_add_request(vllm, llm, vllm_stand_in.LoRARequest("policy-1", 1, str(adapter)))
    with pytest.raises(AssertionError, match="float16 or bfloat16"):
        llm.step()


def test_the_earlier_engine_slept_without_sleep_mode_unless_built_colocated(vllm: types.ModuleType, model: str) -> None:
    # Its sleep() called LLM.sleep whatever the engine was built with. No caller did so then:
    # colocated runs once did not use vLLM.
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        _earlier_engine_llm(vllm, model).sleep(level=2)
    _earlier_engine_llm(vllm, model, colocated=True).sleep(level=2)


def test_tensor_parallel_needs_a_gpu_per_worker_and_heads_it_divides(
    tmp_path: Path, vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    smollm2 = str(write_checkpoint(tmp_path / "smollm2", num_attention_heads=9, num_key_value_heads=3))
    llama = str(write_checkpoint(tmp_path / "llama", num_attention_heads=32, num_key_value_heads=8))
    # One process per GPU: the stand-in's machine has one.
    with pytest.raises(ValueError, match=r"World size \(2\) is larger than the number of available GPUs \(1\)"):
        LLM(llama, tensor_parallel_size=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert LLM(llama, tensor_parallel_size=4).options["tensor_parallel_size"] == 4
    with pytest.raises(ValueError, match=r"World size \(8\) is larger than the number of available GPUs \(4\)"):
        LLM(llama, tensor_parallel_size=8)
    # Attention heads split evenly, when LLM() builds its config.
    with pytest.raises(ValueError, match=r"Total number of attention heads \(9\) must be divisible by tensor parallel"):
        LLM(smollm2, tensor_parallel_size=2)
    LLM(smollm2, tensor_parallel_size=3)  # 9 heads, 3 KV heads: one each
    # Key/value heads: divided by T, or one replicated on T / KV GPUs; else the workers' assert.
    odd_kv = str(write_checkpoint(tmp_path / "odd", num_attention_heads=12, num_key_value_heads=3))
    with pytest.raises(AssertionError, match="4 is not divisible by 3"):
        LLM(odd_kv, tensor_parallel_size=4)
    LLM(str(write_checkpoint(tmp_path / "mqa", num_attention_heads=4, num_key_value_heads=1)), tensor_parallel_size=4)
