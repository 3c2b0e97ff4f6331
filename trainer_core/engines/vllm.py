"""Sampling with vLLM's offline engine (`vllm.LLM`) on a GPU.

NOT RUN HERE: vLLM needs a GPU and this project's machines have none. Every call into vLLM below
was checked against the Python source of the vLLM 0.31.0 wheel (the file:line citations are
inside that wheel), then against 0.30.0's and 0.32.0's, which take the same calls and behave the
same but where said (`unservable_adapter_features`, the stand-in's `sleep`); the tests run this
module against a stand-in `vllm` (tests/trainer_core/engines/vllm_stand_in.py) that enforces
those contracts.

Two ways to push new full weights, as vLLM's engine runs in another process by default
(VLLM_ENABLE_V1_MULTIPROCESSING, envs.py:1429), where `collective_rpc` arguments travel by msgpack:
no callable unless VLLM_ALLOW_INSECURE_SERIALIZATION=1, and tensors arrive as plain lists
(v1/serial_utils.py:220, 256-272; decoded untyped at v1/engine/core.py:1836):
- `load_weights_from(dir)`: the worker's `reload_weights(weights_path=dir)` reads the checkpoint
  there (v1/worker/gpu_model_runner.py:5492), with its layerwise post-processing; only a path
  crosses the process boundary. For rollout workers, which have each version on disk.
- `load_weights(named_tensors)` / `set_model(model)`: in process only (`colocated=True`, which
  sets VLLM_ENABLE_V1_MULTIPROCESSING=0 while `LLM()` is built), the tensors go to the same
  `reload_weights(weights_iterator=...)` with no copy through a socket. For colocated runs.
Either way vLLM only logs a warning for the model's weights a push leaves out, and goes on
serving their old values (v1/worker/gpu_model_runner.py:5571-5577): so the engine compares the
names it pushes with the checkpoint's first, and refuses a push that does not match.
vLLM 0.31 also has a weight-transfer API (`LLM.init_weight_transfer_engine` / `update_weights`,
entrypoints/llm.py:870-912), for a trainer sending weights from other GPUs; spotrl does not need it.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from contracts.tensor_parallel import tensor_parallel_problem
from trainer_core.engines.hf import Completion, SamplingParams, never
from trainer_core.engines.openai import check_server_sampling
from trainer_core.models.loading import stop_token_ids

INSTALL_HINT = (
    "the vllm generation engine needs vLLM and a CUDA GPU: pip install 'spotrl[gpu]' "
    "(vLLM 0.30-0.32, built for the torch 2.13.0 that spotrl pins)"
)
# vLLM's LoRAConfig.max_lora_rank is one of these (MaxLoRARanks, config/lora.py:27).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's ModelDType (config/model.py:99), less "auto": that turns fp32 checkpoints into bf16
# (config/model.py:2373), so spotrl always names the dtype.
VLLM_DTYPES = ("float32", "bfloat16", "float16")
# vLLM's LoRA kernels take these only: lora_shrink asserts it (lora/ops/triton_ops/
# lora_shrink_op.py:175, called from lora/punica_wrapper/punica_gpu.py:114) at the first forward
# pass of a request with an adapter.
LORA_DTYPES = ("bfloat16", "float16")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # of the whole GPU, weights and KV cache (vLLM's: 0.92)
PREFIX_CACHE_RESET_TIMEOUT_S = 30.0


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm


def max_lora_rank_for(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    for allowed in MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters of rank up to {MAX_LORA_RANKS[-1]}, not {rank}: lower lora_rank")


def serving_dtype(model: str | Path, dtype: str | None, *, lora: bool) -> str:
    """The dtype vLLM serves `model` in: `dtype`, by default the checkpoint's, but bfloat16 for a
    float32 checkpoint with LoRA, which vLLM's LoRA kernels do not take (LORA_DTYPES)."""
    if dtype is None:
        dtype = checkpoint_dtype(model)
        return "bfloat16" if lora and dtype not in LORA_DTYPES else dtype
    if lora and dtype not in LORA_DTYPES:
        raise ValueError(
            f"vLLM's LoRA kernels take {' or '.join(LORA_DTYPES)} weights, not {dtype}: "
            "pass dtype='bfloat16' (or leave it unset for bfloat16 on a float32 checkpoint)"
        )
    return dtype


def check_tensor_parallel(model_dir: str | Path, size: int) -> None:
    """Raise ValueError, saying what to change, unless vLLM shards the model in `model_dir` over
    `size` GPUs (`tensor_parallel_problem`: its attention and key/value heads must split evenly)."""
    config_file = Path(model_dir) / "config.json"
    config = _json_file(config_file, f"cannot read {config_file} to check that the model shards over {size} GPUs")
    problem = tensor_parallel_problem(config, size)
    if problem is not None:
        raise ValueError(f"{model_dir}: {problem}")


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype the checkpoint in `model_dir` was saved in (config.json's `dtype`, formerly
    `torch_dtype`), as vLLM names it."""
    config_file = Path(model_dir) / "config.json"
    config = _json_file(
        config_file, f"cannot read {config_file} to learn the checkpoint's dtype: pass dtype explicitly"
    )
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"{config_file} names dtype {dtype!r}: pass dtype, one of {', '.join(VLLM_DTYPES)}")
    return dtype


def checkpoint_weight_names(model_dir: str | Path) -> frozenset[str]:
    """Names of the tensors of the safetensors checkpoint in `model_dir`: its index's, else
    those in the headers of its files (nothing else is read)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return frozenset(json.loads(index.read_text())["weight_map"])
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no safetensors checkpoint to read weight names from")
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return frozenset(names)


def unmatched_weights(
    expected: frozenset[str], pushed: Sequence[tuple[str, torch.Tensor | None]]
) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the names of `expected` that `pushed` lacks, and those it has that
    `expected` lacks, less tied copies: a tensor sharing storage with a pushed weight of
    `expected`, as `lm_head.weight` of tied embeddings, which save_pretrained leaves out and
    vLLM skips. A tensor may be None (names read from a checkpoint)."""
    names = {name for name, _ in pushed}
    known = {t.data_ptr() for name, t in pushed if name in expected and t is not None}
    unexpected = [n for n, t in pushed if n not in expected and (t is None or t.data_ptr() not in known)]
    return sorted(expected - names), sorted(unexpected)


def unservable_adapter_features(config: Mapping[str, Any], max_lora_rank: int) -> list[str]:
    """What vLLM refuses in a PEFT adapter_config.json (lora/peft_helper.py:41-56 and 128-136 in
    vLLM 0.31; 0.32 adds the features marked so), or ignores, serving another adapter than PEFT
    would (rank_pattern and alpha_pattern, before 0.32). spotrl's adapters (models/lora.py) have none."""
    init = config.get("init_lora_weights")
    features = {
        "modules_to_save": any(m not in ("classifier", "score") for m in config.get("modules_to_save") or ()),
        "DoRA (use_dora)": config.get("use_dora"),
        "a bias (bias)": config.get("bias", "none") != "none",
        "a LoRA bias (lora_bias, from vLLM 0.32)": config.get("lora_bias"),
        "per-module ranks (rank_pattern, alpha_pattern)": config.get("rank_pattern") or config.get("alpha_pattern"),
        # PiSSA, OLoRA, CorDA and LoftQ change the base weights when PEFT loads the adapter.
        f"init_lora_weights {init!r} (from vLLM 0.32)": isinstance(init, str)
        and init.lower() in ("pissa", "olora", "corda", "loftq"),
        f"rank {config.get('r')}, above the engine's max_lora_rank {max_lora_rank}": config.get("r", 0) > max_lora_rank,
    }
    return [feature for feature, present in features.items() if present]


def check_servable_adapter(adapter_dir: str | Path, max_lora_rank: int) -> None:
    """Raise ValueError unless vLLM serves the PEFT adapter saved in `adapter_dir` as PEFT does:
    a plain LoRA of rank up to `max_lora_rank`. vLLM itself refuses only when a worker first
    loads the adapter, during the engine step that schedules a request for it."""
    config = _json_file(
        Path(adapter_dir) / "adapter_config.json",
        f"{adapter_dir} holds no PEFT adapter (adapter_config.json) for vLLM to load",
    )
    refused = unservable_adapter_features(config, max_lora_rank)
    if refused:
        raise ValueError(
            f"vLLM cannot serve the adapter in {adapter_dir}: it has {', '.join(refused)}. Train a plain LoRA "
            "adapter (spotrl's training.lora_rank makes one), or sample with engine hf"
        )


def _json_file(path: Path, unreadable: str) -> dict[str, Any]:
    """The JSON object in `path`; ValueError(`unreadable`) when the file cannot be read."""
    try:
        return json.loads(path.read_text())
    except OSError:
        raise ValueError(unreadable) from None


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`os.environ[name]` is `value` within the block, as it was before after it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


class VLLMEngine:
    """`GenerationEngine` over `vllm.LLM`, with the hooks an RL loop needs: new weights for each
    policy version (`load_weights_from`, or in process `load_weights` / `set_model`), a LoRA
    adapter per version (`set_lora`), and sleeping while a colocated trainer uses the GPU
    (`sleep`, `wake_up`).

    Log-probs: the engine runs with logprobs_mode="processed_logprobs", so a sampled token's
    log-prob is log_softmax(logits / temperature), as `Completion.logprobs` promises (vLLM's
    default, raw_logprobs, ignores the temperature). Request `i` of a batch samples with seed
    `seed + i`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stop_ids: Sequence[int] | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        lora_rank: int | None = None,
        colocated: bool = False,
        tensor_parallel_size: int = 1,
        **llm_options: Any,
    ) -> None:
        """`model` is a Hugging Face model directory; vLLM serves it in `dtype` (default: the
        checkpoint's, but bfloat16 for a float32 checkpoint with LoRA: `serving_dtype`) within
        `gpu_memory_utilization` of the GPU. `lora_rank` enables LoRA adapters of up to that rank
        (rounded up to a rank vLLM allows). `tensor_parallel_size` shards the model over that many of
        the visible GPUs, one vLLM worker process each (`check_tensor_parallel` says first whether
        the model's heads split so). `colocated` is for a trainer in this process sharing
        the GPU: it enables vLLM's sleep mode and runs vLLM's engine in this process
        (`load_weights`). `llm_options` go to `vllm.LLM` as they are
        (max_model_len, enforce_eager, ...). Completions end at the first of `stop_ids`, by
        default the tokenizer's eos and end-of-turn tokens (vLLM also stops at the model's own eos)."""
        vllm = _import_vllm()
        self.tokenizer = tokenizer  # callers encode prompts and decode completions with it
        if stop_ids is None:
            stop_ids = stop_token_ids(tokenizer) if tokenizer is not None else []
        self.stop_ids = list(stop_ids)
        self._vllm = vllm
        from vllm.sampling_params import RequestOutputKind

        # Only finished requests come out of `step` (sampling_params.py:194): the default,
        # CUMULATIVE, rebuilds every unfinished request's token and log-prob lists each step.
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._max_lora_rank = max_lora_rank_for(lora_rank) if lora_rank else 0
        if lora_rank:
            llm_options |= {"enable_lora": True, "max_lora_rank": self._max_lora_rank}
        dtype = serving_dtype(model, dtype, lora=bool(lora_rank))
        if tensor_parallel_size > 1:
            check_tensor_parallel(model, tensor_parallel_size)
        # What pushes must match: the weights vLLM loads from `model` (a local directory).
        self._weight_names = checkpoint_weight_names(model) if Path(model).is_dir() else None
        self._model = str(model)
        self.in_process = colocated
        # vLLM reads the switch when LLM() builds its engine (v1/engine/llm_engine.py:180); an
        # engine in this process then caches every VLLM_* variable for the process
        # (v1/engine/core.py:252, envs.py:2249), so restoring it afterwards changes nothing for
        # vLLM: only for the rest of this process and the processes it starts.
        in_process = _environ("VLLM_ENABLE_V1_MULTIPROCESSING", "0") if colocated else nullcontext()
        with in_process:
            self._llm = vllm.LLM(
                model=str(model),
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                # The cumem allocator that sleep() frees memory through (config/model.py:621).
                enable_sleep_mode=colocated,
                tensor_parallel_size=tensor_parallel_size,
                **llm_options,
            )
        self._lora_enabled = bool(lora_rank)
        self._lora_request: Any = None
        self._lora_ids = itertools.count(1)  # vLLM's LoRA ids start at 1 (lora/request.py:39)
        self._weights_asleep = False
        self._cache_asleep = False
        self._weights_dropped = False  # by sleep(level=2), until new weights are loaded

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        should_stop: Callable[[], bool] = never,
    ) -> list[Completion] | None:
        """One completion per prompt, in order; None if `should_stop()` turned True meanwhile
        (checked between engine steps; unfinished requests are then aborted)."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        check_server_sampling(params)
        if self._weights_dropped:
            raise RuntimeError("sleep(level=2) dropped the weights: call load_weights or set_model before generate")
        self.wake_up()
        engine = self._llm.llm_engine
        batch = uuid.uuid4().hex[:8]
        request_ids = [f"spotrl-{batch}-{i}" for i in range(len(prompts))]
        for i, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            options = sampling_options(params, None if seed is None else seed + i, self.stop_ids)
            engine.add_request(
                request_id,
                self._vllm.TokensPrompt(prompt_token_ids=list(prompt)),  # inputs/llm.py:111
                self._vllm.SamplingParams(**options, output_kind=self._final_only),
                lora_request=self._lora_request,
            )
        finished: dict[str, Any] = {}
        try:
            while engine.has_unfinished_requests():
                if should_stop():
                    return None
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            unfinished = [r for r in request_ids if r not in finished]
            if unfinished:
                engine.abort_request(unfinished)
        return [completion_from_vllm(finished[r].outputs[0], self.stop_ids) for r in request_ids]

    def load_weights_from(self, model_dir: str | Path) -> None:
        """Serve the full-weight checkpoint saved in `model_dir` (safetensors, names as in the
        Hugging Face checkpoint) from now on. Only the path crosses into vLLM's engine process."""
        self._check_names([(name, None) for name in checkpoint_weight_names(model_dir)], f"the weights in {model_dir}")
        self._reload_weights({"weights_path": str(model_dir)})

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights with `named_tensors` (names as in the Hugging Face
        checkpoint). In process only (`colocated=True`): across processes vLLM would receive
        the tensors as plain lists."""
        if not self.in_process:
            raise RuntimeError(
                "load_weights passes tensors, which reach vLLM's engine process as plain lists: "
                "build the engine with colocated=True, or save the weights and call load_weights_from(dir)"
            )
        named = list(named_tensors)  # the tensors themselves, not copies
        self._check_names(named, "the weights pushed")
        self._reload_weights({"weights_iterator": iter(named)})

    def _check_names(self, pushed: Sequence[tuple[str, torch.Tensor | None]], what: str) -> None:
        """Raise unless the names `pushed` are those of the served model's checkpoint
        (`unmatched_weights`): vLLM would keep serving its old values of any weight left out."""
        if self._weight_names is None:
            raise ValueError(
                f"cannot check the names of new weights against {self._model}, not a local checkpoint "
                "directory: build the engine from the model's directory"
            )
        missing, unexpected = unmatched_weights(self._weight_names, pushed)
        found = [(f"{len(names)} {kind}", names) for kind, names in (("missing", missing), ("unknown", unexpected))]
        if missing or unexpected:
            raise ValueError(
                f"{what} do not match the weights of the served model ({self._model}): "
                + "; ".join(f"{count}, e.g. {names[:3]}" for count, names in found if names)
                + ". vLLM keeps serving the old values of weights a push leaves out: push every weight, named as "
                "in the model's Hugging Face checkpoint (a peft model's names are not: push its adapter with set_lora)"
            )

    def _reload_weights(self, source: dict[str, Any]) -> None:
        if self._weights_asleep:
            # Loading into offloaded weights writes to memory that waking up then overwrites.
            self._llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        # The worker's reload_weights (v1/worker/gpu_worker.py:566), by name: a name needs no
        # pickling, and it runs vLLM's layerwise post-processing after the load.
        self._llm.collective_rpc("reload_weights", kwargs=source)
        self._weights_dropped = False
        self._reset_prefix_cache()

    def _reset_prefix_cache(self, timeout_s: float = PREFIX_CACHE_RESET_TIMEOUT_S) -> None:
        """Drop cached prefixes, whose keys and values the old weights computed. vLLM refuses
        (returns False) while requests hold cache blocks (v1/core/block_pool.py:840-845): in
        its engine process, requests aborted a moment ago may still do. So this retries, and
        fails after `timeout_s`: sampling would go on reusing the old weights' keys and values."""
        deadline = time.monotonic() + timeout_s
        while not self._llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM kept its prefix cache for {timeout_s:.0f} s after a weight update, as requests still "
                    "hold it: finish or abort them before loading new weights"
                )
            time.sleep(0.05)

    def set_model(self, model: torch.nn.Module) -> None:
        """Serve `model`'s weights from now on (after a training step in this process), as
        `HFEngine.set_model`."""
        self.load_weights(model.state_dict().items())

    def set_lora(self, adapter_dir: str | Path | None) -> None:
        """Sample through the PEFT adapter saved in `adapter_dir` from now on; None for the base.

        Each call gets a fresh adapter id: vLLM caches adapters by id, so reusing one would keep
        serving the previous version's weights.
        """
        if adapter_dir is None:
            self._lora_request = None
            return
        if not self._lora_enabled:
            raise RuntimeError("this vLLM engine was built without LoRA: pass lora_rank to VLLMEngine")
        check_servable_adapter(adapter_dir, self._max_lora_rank)
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        self._lora_request = LoRARequest(f"policy-{lora_id}", lora_id, str(adapter_dir))

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for a colocated trainer: level 1 moves the weights to CPU memory, level 2
        drops them (new weights must then be loaded before the next `generate`); both drop the
        KV cache. Needs `colocated=True` (vLLM's sleep mode)."""
        if not self.in_process:
            raise RuntimeError("sleep needs vLLM's sleep mode: build the engine with colocated=True")
        self._llm.sleep(level=level)
        self._weights_asleep = self._cache_asleep = True
        self._weights_dropped = level >= 2

    def wake_up(self) -> None:
        """Take the GPU back after `sleep`; a no-op when awake."""
        tags = [t for t, asleep in (("weights", self._weights_asleep), ("kv_cache", self._cache_asleep)) if asleep]
        if tags:
            self._llm.wake_up(tags=tags)
        self._weights_asleep = self._cache_asleep = False


def sampling_options(params: SamplingParams, seed: int | None, stop_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one request.

    Plain temperature sampling (vLLM's own defaults leave top-k, min-p and penalties off); one
    log-prob per step, the sampled token's (`logprobs=0`); no detokenising, as the caller
    decodes the token ids itself.
    """
    options: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": list(stop_ids),
        "detokenize": False,
    }
    if seed is not None:
        options["seed"] = seed
    return options


def completion_from_vllm(output: Any, stop_ids: Sequence[int]) -> Completion:
    """A `Completion` from a vLLM `CompletionOutput`: `token_ids`, `logprobs` (one
    {token_id: Logprob} mapping per step) and `finish_reason` ("stop", "length" or "abort")."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None:
        raise ValueError("vLLM returned no log-probs: the request must set SamplingParams.logprobs")
    logprobs = [_sampled_logprob(step, token) for step, token in zip(output.logprobs, token_ids, strict=True)]
    stops = set(stop_ids)
    for i, token in enumerate(token_ids):
        if token in stops:  # vLLM keeps the stop token in token_ids
            return Completion(token_ids=token_ids[: i + 1], logprobs=logprobs[: i + 1], finish_reason="stop")
    if output.finish_reason not in ("stop", "length"):
        raise ValueError(f"vLLM ended a completion with finish_reason {output.finish_reason!r}")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=output.finish_reason)


def _sampled_logprob(step: Mapping[int, Any], token: int) -> float:
    if token not in step:
        raise ValueError(f"vLLM's log-probs for a step lack the sampled token {token}")
    return float(step[token].logprob)
