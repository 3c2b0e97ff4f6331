"""A stand-in `vllm` module for machines without a GPU, enforcing the contracts of vLLM 0.31.0
that `VLLMEngine` relies on. Each contract was read in the wheel's Python source
(`pip download vllm==0.31.0 --no-deps`); the file:line citations are inside that wheel.

What it enforces, and where vLLM does the same:
- `LLM(**options)` takes only LLM.__init__'s parameters and EngineArgs' fields
  (entrypoints/llm.py:180, engine/arg_utils.py:464; the list is vllm_0_31_llm_options.txt);
  `dtype` is a ModelDType (config/model.py:99); `max_lora_rank` one of MaxLoRARanks
  (config/lora.py:27).
- `collective_rpc` across processes (VLLM_ENABLE_V1_MULTIPROCESSING, on unless set to 0:
  envs.py:1429, v1/engine/llm_engine.py:180) sends its arguments with msgpack: a callable or
  any other object msgpack cannot encode raises TypeError unless
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 (v1/serial_utils.py:220), and a tensor always arrives as a
  plain [dtype, shape, data] list (encoded at v1/serial_utils.py:256-272; the engine core decodes
  utility calls with an untyped decoder, v1/engine/core.py:1766 and 1836, so nothing rebuilds
  it). In process the call is direct (v1/executor/uniproc_executor.py:103).
- the worker method `reload_weights(weights_iterator=None, weights_path=None,
  is_checkpoint_format=True)` (v1/worker/gpu_model_runner.py:5492) reads the checkpoint at
  `weights_path` and makes it the model's path from then on (line 5534). Weights are matched to
  the model's by name: an unknown name raises (AutoWeightsLoader, model_executor/models/
  utils.py:427), but a tied copy is skipped (`lm_head.weight` of tied embeddings, line 259); a
  weight the push leaves out keeps its old value, and vLLM only logs a warning
  (gpu_model_runner.py:5571-5577): the stand-in raises. The model's names are those of the
  checkpoint it was built from.
- `reset_prefix_cache()` returns a bool, False while requests hold KV blocks
  (entrypoints/llm.py:802, v1/core/block_pool.py:840-845).
- a `lora_request` without `enable_lora` raises "LoRA is not enabled!"
  (v1/engine/input_processor.py:249); vLLM's PEFTHelper refuses an adapter_config.json without
  r, lora_alpha and target_modules, or with modules_to_save (but a classifier's), DoRA, a bias,
  or a rank above `max_lora_rank` (lora/peft_helper.py:41-56, 78-81, 123-136; vLLM raises when a
  worker first loads the adapter, during the step that schedules the request, the stand-in
  already in `add_request`); LoRA ids start at 1 (lora/request.py:39). A step of a request with
  an adapter on float32 weights fails vLLM's LoRA kernel's assert of fp16/bf16 inputs
  (lora/ops/triton_ops/lora_shrink_op.py:175, from lora/punica_wrapper/punica_gpu.py:114);
  `dtype="auto"` serves a float32 checkpoint in bfloat16 (config/model.py:2373).
- `sleep` frees memory only with `enable_sleep_mode` (its cumem allocator, config/model.py:621);
  vLLM itself then silently frees nothing, the stand-in raises. It first pauses the scheduler
  and aborts the requests in flight (mode "abort", v1/engine/core.py:881-909, 919-936): across
  processes their outputs come back finished "abort" (core.py:2012-2015); in process nothing
  reports them, so `has_unfinished_requests()` stays True (the stand-in's `step` then raises)
  until they are aborted by id. While anything sleeps the scheduler stays paused (core.py:
  957-979) and `step` returns nothing, so a generate loop would spin forever: the stand-in
  raises. Sleeping again while the weights sleep does nothing but warn
  (v1/executor/abstract.py:347-350; in vLLM 0.30 while anything sleeps): the stand-in raises
  while anything sleeps.
- `wake_up` tags are "weights", "kv_cache", "scheduling" (entrypoints/llm.py:842); waking a tag
  that does not sleep makes vLLM log a warning and wake none of the tags
  (v1/executor/abstract.py:359-368): the stand-in raises.
- `tensor_parallel_size` (T) runs one worker process per GPU: more than the GPUs visible
  (CUDA_VISIBLE_DEVICES; the stand-in's machine has one GPU when it is unset) raises
  ParallelConfig's "World size (T) is larger than the number of available GPUs (N) in this node"
  (config/parallel.py, ParallelConfig.__post_init__); attention heads that T does not divide raise
  "Total number of attention heads (H) must be divisible by tensor parallel size (T)."
  (config/model.py, ModelConfig.verify_with_parallel_config), and key/value heads that T neither
  divides nor is a multiple of fail QKVParallelLinear's `divide` assert in the workers ("K is not
  divisible by T", model_executor/layers/linear.py, distributed/utils.py). These three were read in
  vLLM's main-branch source, not in the 0.31.0 wheel.
- `SamplingParams` takes only its own fields (sampling_params.py:211); with
  `output_kind=RequestOutputKind.FINAL_ONLY` (sampling_params.py:194) `step` returns finished
  requests only, otherwise also every unfinished one with all its tokens so far.

Each request samples token 10 + its seed % 50 (in the tiny model's vocabulary), then token 2
(two engine steps). Every `LLM` built since `install` is in `built`. test_vllm_stand_in.py
checks that each of these contracts fires.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from enum import Enum
from pathlib import Path
from types import FunctionType, SimpleNamespace
from typing import Any, TypedDict

import pytest
import torch

LLM_OPTIONS = frozenset(
    line
    for line in (Path(__file__).parent / "vllm_0_31_llm_options.txt").read_text().split("\n")
    if line and not line.startswith("#")
)
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")
SAMPLING_FIELDS = frozenset(
    [
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "detokenize",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "output_kind",
        "logit_bias",
        "allowed_token_ids",
        "extra_args",
        "bad_words",
    ]
)


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = kwargs
        self.output_kind = kwargs.get("output_kind", RequestOutputKind.CUMULATIVE)


class LoRARequest:
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "") -> None:
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


def across_processes(obj: Any, insecure: bool) -> Any:
    """`obj` as the engine core process receives it from msgpack (v1/serial_utils.py)."""
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    if isinstance(obj, torch.Tensor):
        return [str(obj.dtype).removeprefix("torch."), list(obj.shape), 0]  # no tensor arrives
    if isinstance(obj, list | tuple):
        return [across_processes(x, insecure) for x in obj]
    if isinstance(obj, dict):
        return {k: across_processes(v, insecure) for k, v in obj.items()}
    if not insecure:
        raise TypeError(
            f"Object of type {type(obj)} is not serializableSet VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow "
            "fallback to pickle-based serialization."
        )
    if isinstance(obj, FunctionType):
        return obj  # cloudpickled
    return pickle.loads(pickle.dumps(obj))  # a generator, for one, raises TypeError here


def _weight_names(model_dir: str | Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def visible_gpus() -> int:
    """The GPUs vLLM counts (cuda_device_count_stateless: CUDA_VISIBLE_DEVICES where set); one
    where it is unset, the stand-in's machine."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 1 if visible is None else len([d for d in visible.split(",") if d.strip()])


def _check_tensor_parallel(model: str, size: int) -> None:
    """vLLM's checks of `tensor_parallel_size`, in its order: the world size against the GPUs,
    then the attention heads (both when LLM() builds its config), then the key/value heads (when
    the workers build the model)."""
    if size > 1 and visible_gpus() < size:
        raise ValueError(
            f"World size ({size}) is larger than the number of available GPUs ({visible_gpus()}) in this node. "
            "If this is intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately."
        )
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_attention_heads", 0)
    if heads % size:
        raise ValueError(
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({size})."
        )
    kv_heads = config.get("num_key_value_heads", heads)
    if heads:
        numerator, denominator = (size, kv_heads) if size >= kv_heads else (kv_heads, size)
        assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def _resolved_dtype(model: str, dtype: str) -> str:
    """vLLM's ModelConfig.dtype for LLM(dtype=...) (config/model.py:2355-2378)."""
    if dtype == "auto":
        config = json.loads((Path(model) / "config.json").read_text())
        saved = config.get("dtype") or config.get("torch_dtype") or "float32"
        return "bfloat16" if saved == "float32" else saved
    return {"half": "float16", "float": "float32"}.get(dtype, dtype)


class _Worker:
    """The worker methods spotrl calls through collective_rpc."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        # worker.model_runner.model.load_weights(weights): the model's own loader, without
        # reload_weights' layerwise post-processing (gpu_model_runner.py:5545-5548).
        self.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_tensors))

    def reload_weights(
        self, weights_iterator: Any = None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        llm = self.llm
        if "weights" in llm.sleeping:
            raise RuntimeError("reload_weights while the weights sleep: wake_up(tags=['weights']) first")
        if weights_iterator is None:
            path = Path(weights_path or llm.model)
            if not list(path.glob("*.safetensors")):
                raise RuntimeError(f"Cannot find any model weights with `{path}`")
            self._check_loaded([(name, None) for name in _weight_names(path)])
            llm.model = str(path)
            llm.calls.append(("reload_weights", str(path)))
            return
        llm.calls.append(("reload_weights", self._load_tensors(weights_iterator)))

    def _load_tensors(self, weights: Any) -> list[str]:
        loaded = []
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor):
                raise AttributeError(f"weight {name} arrived as {type(tensor).__name__} {tensor!r}, not a tensor")
            loaded.append((name, tensor))
        self._check_loaded(loaded)
        return [name for name, _ in loaded]

    def _check_loaded(self, loaded: list[tuple[str, torch.Tensor | None]]) -> None:
        params = self.llm.param_names
        storage = {t.data_ptr() for name, t in loaded if name in params and t is not None}
        for name, tensor in loaded:
            if name not in params and (tensor is None or tensor.data_ptr() not in storage):
                raise ValueError(f"There is no module or parameter named {name.split('.')[0]!r} in the model")
        missing = params - {name for name, _ in loaded}
        if missing:
            raise RuntimeError(
                f"Following weights were not loaded from checkpoint: {sorted(missing)} (vLLM only warns, and "
                "serves their old values)"
            )


def _request_output(request_id: str, tokens: list[int], finish_reason: str | None) -> SimpleNamespace:
    """A RequestOutput with one CompletionOutput, finished unless `finish_reason` is None."""
    steps = [{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=None)} for t in tokens]
    out = SimpleNamespace(
        index=0, text="", token_ids=list(tokens), logprobs=steps, finish_reason=finish_reason, stop_reason=None
    )
    return SimpleNamespace(request_id=request_id, finished=finish_reason is not None, outputs=[out])


built: list[LLM] = []


class LLM:
    """`vllm.LLM` and its `llm_engine` (the LLMEngine calls live on the same object)."""

    def __init__(self, model: str, **options: Any) -> None:
        unknown = set(options) - LLM_OPTIONS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        if options.get("dtype", "auto") not in MODEL_DTYPES:
            raise ValueError(f"dtype {options['dtype']!r} is not one of {MODEL_DTYPES}")
        if options.get("max_lora_rank", 16) not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank {options['max_lora_rank']!r} is not one of {MAX_LORA_RANKS}")
        if not 0 < options.get("gpu_memory_utilization", 0.92) <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        _check_tensor_parallel(model, options.get("tensor_parallel_size", 1))
        self.model = model
        self.options = options
        self.dtype = _resolved_dtype(model, options.get("dtype", "auto"))
        self.param_names = _weight_names(model)
        self.multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        self.calls: list[tuple[str, Any]] = []
        self.requests: dict[str, list[Any]] = {}  # request id -> [params, tokens so far, lora request]
        self.aborted_outputs: list[SimpleNamespace] = []  # of requests sleep aborted, across processes
        self.stranded: set[str] = set()  # requests sleep aborted in process: unfinished for good
        self.sleeping: set[str] = set()
        self.busy_resets = 0  # reset_prefix_cache answers False this many more times
        self.intermediate_outputs = 0  # outputs of unfinished requests that step returned
        self.llm_engine = self
        self._worker = _Worker(self)
        built.append(self)

    # LLMEngine
    def add_request(
        self, request_id: str, prompt: Any, params: Any, arrival_time: float | None = None, lora_request: Any = None
    ) -> str:
        if not isinstance(prompt, dict) or set(prompt) - set(TokensPrompt.__annotations__):
            raise TypeError(f"prompt {prompt!r} is not a TokensPrompt")
        if not all(isinstance(t, int) for t in prompt["prompt_token_ids"]):
            raise TypeError("prompt_token_ids must be ints")
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if lora_request is not None:
            if not self.options.get("enable_lora"):
                raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
            self._check_adapter(Path(lora_request.lora_path) / "adapter_config.json")
        self.requests[request_id] = [params, [], lora_request]
        return request_id

    def _check_adapter(self, config_file: Path) -> None:
        """PEFTHelper.from_local_dir(...).validate_legal(lora_config) (lora/peft_helper.py)."""
        config = json.loads(config_file.read_text())
        missing = {"r", "lora_alpha", "target_modules"} - set(config)
        if missing:
            raise ValueError(f"Missing required configuration fields: {missing}")
        errors = []
        unsupported = [m for m in config.get("modules_to_save") or () if m not in ("classifier", "score")]
        if unsupported:
            errors.append(
                'vLLM only supports modules_to_save being either None or ["classifier", "score"] for '
                f"classification models. Unsupported modules_to_save: {unsupported}"
            )
        if config.get("use_dora"):
            errors.append("vLLM does not yet support DoRA.")
        max_lora_rank = self.options.get("max_lora_rank", 16)
        if config["r"] > max_lora_rank:
            errors.append(f"LoRA rank {config['r']} is greater than max_lora_rank {max_lora_rank}.")
        if config.get("bias", "none") != "none":
            errors.append("Adapter bias is not supported.")
        if errors:
            raise ValueError(" ".join(errors))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.aborted_outputs or self.stranded)

    def step(self) -> list[SimpleNamespace]:
        if self.sleeping:
            raise RuntimeError(
                f"step while paused, asleep ({sorted(self.sleeping)}): vLLM schedules nothing and returns no "
                "outputs until every tag is awake, so a generate loop would never end: wake_up first"
            )
        if self.stranded and not self.requests:
            raise RuntimeError(
                f"requests {sorted(self.stranded)} were aborted by sleep in process: vLLM never reports them, so "
                "has_unfinished_requests() stays True and step returns nothing (a generate loop would never end)"
            )
        outputs, self.aborted_outputs = self.aborted_outputs, []
        for request_id in sorted(self.requests, reverse=True):  # out of order
            params, tokens, lora_request = self.requests[request_id]
            if lora_request is not None and self.dtype == "float32":
                # lora_shrink's `assert inputs.dtype in [torch.float16, torch.bfloat16]`
                raise AssertionError(f"vLLM's LoRA kernels take float16 or bfloat16 inputs, not {self.dtype}")
            tokens.append(10 + params.kwargs.get("seed", 0) % 50 if not tokens else 2)
            finished = len(tokens) == 2
            if finished:
                del self.requests[request_id]
            elif params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            else:
                self.intermediate_outputs += 1
            outputs.append(_request_output(request_id, tokens, "stop" if finished else None))
        return outputs

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.calls.append(("abort", sorted(request_ids)))
        for r in request_ids:
            self.requests.pop(r, None)
            self.stranded.discard(r)

    # LLM
    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        kwargs = kwargs or {}
        if self.multiprocess:
            insecure = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") == "1"
            method, args, kwargs = (across_processes(x, insecure) for x in (method, args, kwargs))
        if isinstance(method, str):
            return [getattr(self._worker, method)(*args, **kwargs)]
        return [method(self._worker, *args, **kwargs)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        if self.requests or self.busy_resets > 0:
            self.busy_resets -= 1
            return False
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.options.get("enable_sleep_mode"):
            raise RuntimeError("sleep without LLM(enable_sleep_mode=True) frees no GPU memory")
        if self.sleeping:
            raise RuntimeError(
                f"sleep while {sorted(self.sleeping)} sleep: vLLM logs 'Executor is already sleeping.' and "
                "leaves the memory as it is"
            )
        self.calls.append(("sleep", level))
        for request_id, (_, tokens, _) in sorted(self.requests.items()):  # mode "abort"
            if self.multiprocess:
                self.aborted_outputs.append(_request_output(request_id, tokens, "abort"))
            else:
                self.stranded.add(request_id)
        self.requests.clear()
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and set(tags) - set(WAKE_UP_TAGS):
            raise ValueError(f"wake_up tags must be in {WAKE_UP_TAGS}, not {tags}")
        awake = set(tags or ()) - {"scheduling"} - self.sleeping
        if awake:
            raise RuntimeError(
                f"wake_up({tags}) while only {sorted(self.sleeping)} sleep: vLLM logs 'Tag {sorted(awake)[0]} is not "
                "in sleeping tags' and wakes none of them"
            )
        self.calls.append(("wake_up", tags))
        self.sleeping -= set(tags or WAKE_UP_TAGS)


def write_checkpoint(
    path: Path, dtype: str = "bfloat16", names: tuple[str, ...] = ("weight", "bias"), **heads: int
) -> Path:
    """A model directory as vLLM reads it: config.json (saved in `dtype`, with `heads`:
    num_attention_heads=9, num_key_value_heads=3, say) and a safetensors file of the weights
    `names` (by default those of a torch.nn.Linear(2, 2))."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": dtype, **heads}))
    save_file({name: torch.zeros(2) for name in names}, str(path / "model.safetensors"))
    return path


def write_adapter(path: Path, rank: int, **config: Any) -> Path:
    """A PEFT adapter directory, as far as vLLM's PEFTHelper reads it: adapter_config.json with
    `rank`, and `config` (use_dora=True, say) over the plain LoRA peft saves."""
    path.mkdir(parents=True)
    plain = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    plain |= {"bias": "none", "use_dora": False, "modules_to_save": None}
    (path / "adapter_config.json").write_text(json.dumps(plain | config))
    return path


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Make `import vllm` (and the submodules VLLMEngine imports) give the stand-in until the
    test ends, on a machine of one GPU (CUDA_VISIBLE_DEVICES unset); vLLM's environment switches
    are restored then too."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.TokensPrompt = LLM, SamplingParams, TokensPrompt  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind, sampling.SamplingParams = RequestOutputKind, SamplingParams  # type: ignore[attr-defined]
    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    for name, mod in [
        ("vllm", module),
        ("vllm.sampling_params", sampling),
        ("vllm.lora", types.ModuleType("vllm.lora")),
        ("vllm.lora.request", lora),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    built.clear()
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return module
