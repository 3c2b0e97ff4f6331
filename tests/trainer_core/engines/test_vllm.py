"""VLLMEngine without vLLM (no GPU here): the import, the install hint, the pure helpers on
objects shaped as vLLM documents them, and the engine's own bookkeeping over a stand-in `vllm`
module that records the documented calls. None of this shows that vLLM itself behaves so; that
needs a GPU machine. Also the engine factory, `make_engine`."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer_core.engines import make_engine
from trainer_core.engines.hf import Completion, HFEngine, SamplingParams
from trainer_core.models.loading import Policy
from trainer_core.engines.openai import OpenAIEngine
from trainer_core.engines.vllm import VLLMEngine, completion_from_vllm, sampling_options


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


class _StandInLLM:
    """Records the documented `vllm.LLM` calls; each request emits token 100 + its seed, then 2."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.calls: list[tuple[str, Any]] = []
        self.requests: dict[str, Any] = {}
        self.llm_engine = self

    # LLMEngine
    def add_request(
        self, request_id: str, prompt: dict[str, Any], params: Any, lora_request: Any = None
    ) -> str:
        self.requests[request_id] = (prompt, params, lora_request)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[SimpleNamespace]:
        # Finishes the newest request first, so that outputs arrive out of order.
        request_id = sorted(self.requests)[-1]
        _, params, _ = self.requests.pop(request_id)
        token = 100 + params.kwargs.get("seed", 0)
        out = _output([token, 2], [-0.5, -0.1], "stop")
        return [SimpleNamespace(request_id=request_id, finished=True, outputs=[out])]

    def abort_request(self, request_ids: list[str]) -> None:
        self.calls.append(("abort", sorted(request_ids)))
        for r in request_ids:
            self.requests.pop(r, None)

    # LLM
    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        model = SimpleNamespace(
            load_weights=lambda weights: self.calls.append(("load_weights", [n for n, _ in weights]))
        )
        method(SimpleNamespace(model_runner=SimpleNamespace(model=model)), *args)
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


@pytest.fixture
def stand_in_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType("vllm")
    module.LLM = _StandInLLM  # type: ignore[attr-defined]
    module.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)  # type: ignore[attr-defined]
    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = lambda name, lora_id, path: (name, lora_id, path)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    yield module


def test_generate_keeps_order_seeds_each_request_and_aborts_on_stop(stand_in_vllm: types.ModuleType) -> None:
    engine = VLLMEngine("some/model", stop_ids=[2], gpu_memory_utilization=0.3)
    llm = engine._llm
    assert llm.options["logprobs_mode"] == "processed_logprobs"
    assert llm.options["gpu_memory_utilization"] == 0.3
    completions = engine.generate([[1, 2], [3], [4, 5]], SamplingParams(temperature=1.0), seed=10)
    assert [c.token_ids for c in completions] == [[110, 2], [111, 2], [112, 2]]
    assert engine.generate([[1]], SamplingParams(), should_stop=lambda: True) is None
    assert llm.calls[-1][0] == "abort" and not llm.requests
    with pytest.raises(ValueError, match="top_p=0.9"):
        engine.generate([[1]], SamplingParams(temperature=1.0, top_p=0.9))


def test_weights_adapters_and_sleep(stand_in_vllm: types.ModuleType) -> None:
    engine = VLLMEngine("some/model", colocated=True, max_lora_rank=8)
    llm = engine._llm
    assert llm.options["enable_sleep_mode"] and llm.options["max_lora_rank"] == 8
    engine.set_model(torch.nn.Linear(2, 2))
    assert llm.calls == [("load_weights", ["weight", "bias"]), ("reset_prefix_cache", None)]
    engine.set_lora("/adapters/v1")
    engine.set_lora("/adapters/v2")
    assert engine._lora_request == ("policy-2", 2, "/adapters/v2")  # a new id per version
    llm.calls.clear()
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="dropped the weights"):
        engine.generate([[1]], SamplingParams())
    engine.load_weights([("weight", torch.zeros(2, 2))])
    engine.generate([[1]], SamplingParams(temperature=0.0))
    assert llm.calls[:4] == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("load_weights", ["weight"]),
        ("reset_prefix_cache", None),
    ]
    assert llm.calls[4] == ("wake_up", ["kv_cache"])


def test_make_engine_builds_each_engine_by_name(tiny_policy: Policy, no_vllm: None) -> None:
    assert isinstance(make_engine("hf", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer), HFEngine)
    served = make_engine("openai", base_url="http://127.0.0.1:8000", server="llama.cpp")
    assert isinstance(served, OpenAIEngine) and served.server.value == "llama.cpp"
    with pytest.raises(ImportError, match="spotrl\\[gpu\\]"):
        make_engine("vllm", model="some/model")
    with pytest.raises(
        ValueError, match="unknown generation engine 'sglang': choose one of 'hf', 'openai', 'vllm'"
    ):
        make_engine("sglang")


def test_modules_import_without_vllm() -> None:
    # In a fresh interpreter where `import vllm` fails, whether or not vLLM is installed here.
    code = "import sys; sys.modules['vllm'] = None; import trainer_core.engines, trainer_core.engines.vllm"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
