"""Sampling with vLLM's offline engine (`vllm.LLM`) on a GPU rollout worker.

UNTESTED HERE: vLLM needs a GPU and this project's machines have none. The tests cover what runs
without vLLM: this module imports, `VLLMEngine` without vLLM raises the install hint, and the pure
helpers at the bottom (sampling arguments, output conversion) are checked on objects shaped as
vLLM documents them. The calls into vLLM follow its documented offline API as of vLLM 0.30-0.32
(the releases built for torch 2.13.0): `LLM(..., logprobs_mode=...)`, `LLMEngine.add_request` /
`step` / `abort_request`, `LLM.sleep` / `wake_up`, `LLM.collective_rpc`, `LoRARequest`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer_core.engines.hf import Completion, SamplingParams, never
from trainer_core.models.loading import stop_token_ids
from trainer_core.engines.openai import check_server_sampling

INSTALL_HINT = (
    "the vllm generation engine needs vLLM and a CUDA GPU: pip install 'spotrl[gpu]' "
    "(vLLM 0.30-0.32, built for the torch 2.13.0 that spotrl pins)"
)



def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm


class VLLMEngine:
    """`GenerationEngine` over `vllm.LLM`, with the hooks an RL loop needs: new weights for each
    policy version (`load_weights`, `set_model`), a LoRA adapter per version (`set_lora`), and
    sleeping while a colocated trainer uses the GPU (`sleep`, `wake_up`).

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
        colocated: bool = False,
        max_lora_rank: int | None = None,
        **llm_options: Any,
    ) -> None:
        """`model` is a Hugging Face model directory or hub name. `colocated` enables vLLM's
        sleep mode, for a trainer sharing the GPU; `max_lora_rank` enables LoRA adapters of up to
        that rank. `llm_options` go to `vllm.LLM` as they are (gpu_memory_utilization,
        max_model_len, dtype, ...). Completions end at the first of `stop_ids`, by default the
        tokenizer's eos and end-of-turn tokens (vLLM also stops at the model's own eos)."""
        vllm = _import_vllm()
        self.tokenizer = tokenizer  # callers encode prompts and decode completions with it
        if stop_ids is None:
            stop_ids = stop_token_ids(tokenizer) if tokenizer is not None else []
        self.stop_ids = list(stop_ids)
        self._vllm = vllm
        lora = {"enable_lora": True, "max_lora_rank": max_lora_rank} if max_lora_rank else {}
        self._llm = vllm.LLM(
            model=str(model),
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=colocated,
            **lora,
            **llm_options,
        )
        self._lora_request: Any = None
        self._lora_ids = itertools.count(1)
        self._weights_asleep = False
        self._cache_asleep = False
        self._weights_dropped = False  # by sleep(level=2), until load_weights

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
            raise RuntimeError(
                "sleep(level=2) dropped the weights: call load_weights or set_model before generate"
            )
        self.wake_up()
        engine = self._llm.llm_engine
        batch = uuid.uuid4().hex[:8]
        request_ids = [f"spotrl-{batch}-{i}" for i in range(len(prompts))]
        for i, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            options = sampling_options(params, None if seed is None else seed + i, self.stop_ids)
            engine.add_request(
                request_id,
                {"prompt_token_ids": list(prompt)},  # a TokensPrompt
                self._vllm.SamplingParams(**options),
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

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights in place; names as in the Hugging Face checkpoint.

        The tensors reach every vLLM worker through `LLM.collective_rpc`; with vLLM's engine in
        another process (its default) they are pickled there, so a colocated trainer sets
        VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep them in this process.
        """
        if self._weights_asleep:
            # Loading into offloaded weights writes to memory that waking up then overwrites.
            self._llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        self._llm.collective_rpc(_load_weights_on_worker, args=(list(named_tensors),))
        self._weights_dropped = False
        # Cached prefixes hold keys and values of the old weights.
        self._llm.reset_prefix_cache()

    def set_model(self, model: torch.nn.Module) -> None:
        """Serve `model`'s weights from now on (after a training step), as `HFEngine.set_model`."""
        self.load_weights(model.state_dict().items())

    def set_lora(self, adapter_dir: str | Path | None) -> None:
        """Sample through the PEFT adapter saved in `adapter_dir` from now on; None for the base.

        Each call gets a fresh adapter id: vLLM caches adapters by id, so reusing one would keep
        serving the previous version's weights.
        """
        if adapter_dir is None:
            self._lora_request = None
            return
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        self._lora_request = LoRARequest(f"policy-{lora_id}", lora_id, str(adapter_dir))

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for a colocated trainer: level 1 moves the weights to CPU memory, level 2
        drops them (`load_weights` must then run before the next `generate`); both drop the KV
        cache. Needs `colocated=True`."""
        self._llm.sleep(level=level)
        self._weights_asleep = self._cache_asleep = True
        self._weights_dropped = level >= 2

    def wake_up(self) -> None:
        """Take the GPU back after `sleep`; a no-op when awake."""
        tags = [
            t for t, asleep in (("weights", self._weights_asleep), ("kv_cache", self._cache_asleep)) if asleep
        ]
        if tags:
            self._llm.wake_up(tags=tags)
        self._weights_asleep = self._cache_asleep = False


def _load_weights_on_worker(worker: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    # Runs inside each vLLM worker (collective_rpc passes the worker as the first argument).
    worker.model_runner.model.load_weights(weights=named_tensors)


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
