"""Sampling from an OpenAI-compatible completions server (vLLM, llama.cpp's llama-server).

`OpenAIEngine` sends each prompt as token ids in its own `POST {base_url}/v1/completions`, all of a
batch at once, and needs back the sampled token ids and the log-prob of each. Servers agree on
neither: which request fields make their log-probs mean what `Completion.logprobs` promises
(log_softmax(logits / temperature) at the chosen token, over the whole vocabulary), nor the shape
of the answer. So a `ServerKind` names the fields each server needs, and `parse_choice` reads the
answer shapes of all of them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, TypeVar

import httpx
from transformers import PreTrainedTokenizerBase

from trainer_core.engines.hf import Completion, SamplingParams, never
from trainer_core.models.loading import stop_token_ids

_T = TypeVar("_T")

# How often a batch in flight checks should_stop.
_STOP_POLL_S = 0.05
# vLLM's legacy-shape answers name each token "token_id:<id>" when asked to
# (return_tokens_as_token_ids), so that tokens that are not valid text keep their identity.
_TOKEN_ID_PREFIX = "token_id:"


class ServerError(RuntimeError):
    """The completions server could not be reached, refused a request, or answered without
    what the engine needs; the message says what to change."""


class ServerKind(str, Enum):
    """The server behind `base_url`; it decides the extra request fields (`_REQUEST_FIELDS`).

    vllm: start it with `--logprobs-mode processed_logprobs`, or its log-probs ignore the
    temperature. llama.cpp (llama-server): it reports no log-prob for a token that ends inside a
    multi-byte UTF-8 character, and a batch that meets one fails; fine for tests and ASCII tasks.
    """

    VLLM = "vllm"
    LLAMA_CPP = "llama.cpp"


def _vllm_fields(params: SamplingParams, stop_ids: Sequence[int]) -> dict[str, Any]:
    # vLLM's extensions to the completions request (vllm/entrypoints/openai protocol).
    # Its log-probs follow the server's --logprobs-mode: start it with processed_logprobs, or
    # they are log_softmax(logits) at temperature 1 whatever the request asks.
    return {
        "return_token_ids": True,  # choice.token_ids (vLLM >= 0.10.2)
        "return_tokens_as_token_ids": True,  # logprobs.tokens as "token_id:N" (older releases)
        # The server's defaults come from the model's generation_config (often top_k 20 or a
        # repetition penalty); sampling must be plain temperature for the log-probs to hold.
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": list(stop_ids),
    }


def _llama_cpp_fields(params: SamplingParams, stop_ids: Sequence[int]) -> dict[str, Any]:
    # llama-server reports softmax(logits) at temperature 1 by default, and its default sampler
    # chain adds top-k 40 and min-p 0.05 (tools/server/README.md). Greedy wants exactly the
    # default probabilities; sampling runs temperature alone, whose post-sampling probabilities
    # are then softmax(logits / temperature) over the whole vocabulary.
    # llama-server stops on its own end-of-generation tokens; `stop_ids` are applied on return.
    if params.temperature == 0:
        return {"post_sampling_probs": False}
    return {"samplers": ["temperature"], "post_sampling_probs": True}


_REQUEST_FIELDS: dict[ServerKind, Callable[[SamplingParams, Sequence[int]], dict[str, Any]]] = {
    ServerKind.VLLM: _vllm_fields,
    ServerKind.LLAMA_CPP: _llama_cpp_fields,
}


def check_server_sampling(params: SamplingParams) -> None:
    """Refuse top-p sampling, whose log-probs no server reports as the trainer needs them.

    vLLM (processed_logprobs) and llama-server both report log-probs renormalised over the top-p
    nucleus, while `Completion.logprobs` and the trainer's recomputation are taken before top-p
    filtering: the importance ratio would be off by the nucleus mass at every token.
    """
    if params.temperature > 0 and params.top_p < 1:
        raise ValueError(
            f"top_p={params.top_p} with temperature {params.temperature}: inference servers "
            "report log-probs renormalised over the top-p nucleus, not the full-vocabulary "
            "ones the trainer's importance ratio needs; use top_p=1 with this engine, or the "
            "hf engine for top-p sampling"
        )


def parse_choice(
    choice: Mapping[str, Any], completion_tokens: int | None = None
) -> tuple[list[int], list[float], str | None]:
    """Token ids, their log-probs and the server's finish_reason from one completions choice;
    `completion_tokens` (the answer's usage) is the number of tokens the server generated.

    Two answer shapes are read:
    - llama-server: `logprobs.content`, one entry per token with its `id` and `logprob`, or
      `prob` (linear) when post-sampling probabilities were asked for;
    - OpenAI's legacy shape (vLLM): parallel `logprobs.tokens` / `logprobs.token_logprobs`,
      with the ids in `choice.token_ids`, or in tokens written "token_id:N".
    """
    logprobs = choice.get("logprobs")
    if not logprobs:
        raise ServerError(
            "the server answered without per-token log-probs: use a server that honours "
            "`logprobs` on /v1/completions (vLLM, llama.cpp's llama-server)"
        )
    content = logprobs.get("content")
    if content is not None:
        ids = [int(entry["id"]) for entry in content]
        values = [entry["logprob"] if "logprob" in entry else _log(entry.get("prob")) for entry in content]
    else:
        values = list(logprobs.get("token_logprobs") or [])
        if choice.get("token_ids") is not None:
            ids = [int(t) for t in choice["token_ids"]]
        else:
            ids = [_token_id(t) for t in logprobs.get("tokens") or []]
    if len(ids) != len(values):
        raise ServerError(f"the server answered {len(ids)} token ids but {len(values)} log-probs")
    if completion_tokens is not None and completion_tokens != len(ids):
        # llama-server holds back the text of a token that ends inside a multi-byte UTF-8
        # character and never reports that token's log-prob (emoji, CJK in English vocabularies).
        raise ServerError(
            f"the server generated {completion_tokens} tokens but reported log-probs for {len(ids)}: "
            "llama-server skips tokens that end inside a multi-byte UTF-8 character, so such a "
            "completion cannot be scored; serve the policy with vLLM, which reports every token"
        )
    bad = [v for v in values if not isinstance(v, int | float) or not math.isfinite(v)]
    if bad:
        raise ServerError(f"the server answered non-finite log-probs {bad[:3]} for sampled tokens")
    return ids, [float(v) for v in values], choice.get("finish_reason")


def to_completion(
    ids: Sequence[int], logprobs: Sequence[float], finish_reason: str | None, stop_ids: Sequence[int]
) -> Completion:
    """A `Completion` cut after the first stop token, which it keeps, as `HFEngine` does."""
    stops = set(stop_ids)
    for i, token in enumerate(ids):
        if token in stops:
            return Completion(token_ids=list(ids[: i + 1]), logprobs=list(logprobs[: i + 1]), finish_reason="stop")
    if finish_reason not in ("stop", "length"):
        raise ServerError(f"the server ended a completion with finish_reason {finish_reason!r}")
    return Completion(token_ids=list(ids), logprobs=list(logprobs), finish_reason=finish_reason)


class OpenAIEngine:
    """`GenerationEngine` over an OpenAI-compatible completions server.

    Request `i` of a batch samples with seed `seed + i` (each request is sampled on its own, so
    one seed for all would give copies of a prompt identical completions). Which weights the
    server holds is its business: reload them there when the policy version changes.
    """

    def __init__(
        self,
        base_url: str,
        *,
        server: ServerKind | str = ServerKind.VLLM,
        model: str | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stop_ids: Sequence[int] | None = None,
        max_concurrency: int = 32,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        """`base_url` is the server's root (a trailing /v1 is accepted); `model` is sent as the
        request's model name, when the server wants one. Completions end at the first of
        `stop_ids`, by default the tokenizer's eos and end-of-turn tokens."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.server = ServerKind(server)
        self.model = model
        self.tokenizer = tokenizer  # callers encode prompts and decode completions with it
        if stop_ids is None:
            stop_ids = stop_token_ids(tokenizer) if tokenizer is not None else []
        self.stop_ids = list(stop_ids)
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        should_stop: Callable[[], bool] = never,
    ) -> list[Completion] | None:
        """One completion per prompt, in order; None if `should_stop()` turned True meanwhile
        (requests still in flight are then abandoned, which lets the server drop them)."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        check_server_sampling(params)
        bodies = [self._request(prompt, params, None if seed is None else seed + i) for i, prompt in enumerate(prompts)]
        answers = _run_blocking(lambda: self._complete_all(bodies, should_stop))
        if answers is None:
            return None
        return [
            to_completion(
                *parse_choice(answer["choices"][0], (answer.get("usage") or {}).get("completion_tokens")),
                self.stop_ids,
            )
            for answer in answers
        ]

    def _request(self, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 1,  # the sampled token's log-prob is always included
            "stream": False,
            **_REQUEST_FIELDS[self.server](params, self.stop_ids),
        }
        if seed is not None:
            body["seed"] = seed
        if self.model is not None:
            body["model"] = self.model
        return body

    async def _complete_all(
        self, bodies: Sequence[dict[str, Any]], should_stop: Callable[[], bool]
    ) -> list[dict[str, Any]] | None:
        """Each request's answer, in order; None on `should_stop()`."""
        if should_stop():
            return None
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, headers=self._headers) as client:

            async def complete(body: dict[str, Any]) -> dict[str, Any]:
                async with limit:
                    return await self._post(client, body)

            tasks = [asyncio.create_task(complete(body)) for body in bodies]
            try:
                pending: set[asyncio.Task[dict[str, Any]]] = set(tasks)
                while pending:
                    if should_stop():
                        return None
                    done, pending = await asyncio.wait(
                        pending, timeout=_STOP_POLL_S, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done:
                        task.result()  # the first failure ends the batch
                return [task.result() for task in tasks]
            finally:
                # Cancelling closes those connections; servers drop a request whose client left.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}/v1/completions"
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.ConnectError as e:
            raise ServerError(
                f"could not connect to {url} ({e}): start the completions server there, or correct base_url"
            ) from e
        except httpx.TimeoutException as e:
            raise ServerError(
                f"{url} did not answer within {self.timeout_s:g} s: raise timeout_s, or send fewer "
                "prompts or fewer max_new_tokens per batch"
            ) from e
        if response.is_error:
            raise ServerError(
                f"{url} answered HTTP {response.status_code}: {response.text[:500]!r}. base_url must be the "
                "root of an OpenAI-compatible completions server that accepts token-id prompts "
                f"(vLLM, llama.cpp's llama-server), server={self.server.value!r} must name it, and "
                "model must be one it serves"
            )
        answer = response.json()
        if not answer.get("choices"):
            raise ServerError(f"{url} answered without choices: {response.text[:500]!r}")
        return answer


def _log(prob: Any) -> float:
    if not isinstance(prob, int | float) or prob <= 0:
        raise ServerError(f"the server answered probability {prob!r} for a sampled token")
    return math.log(prob)


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        return int(token.removeprefix(_TOKEN_ID_PREFIX))
    raise ServerError(
        f"the server named a sampled token {token!r} by its text, not its id: for vLLM pass "
        "server='vllm', whose requests ask for token ids (return_token_ids)"
    )


def _run_blocking(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from synchronous code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    # Called from inside an event loop: this call must block anyway, so run it on its own loop
    # in a helper thread rather than fail.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
