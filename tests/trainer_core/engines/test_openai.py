"""OpenAIEngine against a real completions server: llama.cpp's server (xllamacpp wheel) serving the
SmolLM2-135M GGUF, compared with HFEngine on the same file's weights dequantised to fp32.

Log-prob tolerance: both sides hold the same Q4_1 weights (dequantising is exact), but llama.cpp
quantises activations to 8 bits for its Q4_1 matmuls and keeps an f16 KV cache. Measured on
40-token completions: mean |difference| 0.04-0.06 nats, max 0.25. Asserted: mean < 0.1, max < 0.5.
A wrong temperature (log-probs at T=1 for a T=0.7 sample) measured a mean difference of 0.24.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import httpx
import pytest
import torch
import torch.nn.functional as F
from openai_server import llama_server, smollm2_gguf

from tests.servers.process import free_port
from trainer_core.engines.hf import Completion, GenerationEngine, HFEngine, SamplingParams
from trainer_core.engines.openai import OpenAIEngine, ServerError, parse_choice, to_completion
from trainer_core.models.loading import Policy, encode_prompt

TEXTS = ("What is 2+2?", "Name a colour.")
MEAN_TOL = 0.1
MAX_TOL = 0.5


@pytest.fixture(scope="module")
def smollm2(smollm2_converted: Policy) -> Policy:
    return smollm2_converted  # converted once per session, shared with the loading test


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(smollm2_gguf(), tmp_path_factory.mktemp("llama-server")) as url:
        yield url


@pytest.fixture
def engine(server_url: str, smollm2: Policy) -> OpenAIEngine:
    return OpenAIEngine(server_url, server="llama.cpp", tokenizer=smollm2.tokenizer)


def _prompts(policy: Policy, texts: Sequence[str] = TEXTS) -> list[list[int]]:
    return [encode_prompt(policy.tokenizer, text) for text in texts]


def _teacher_forced_logprobs(
    policy: Policy, prompt: list[int], completion: Completion, temperature: float
) -> torch.Tensor:
    """HF's log-probs of the completion's tokens, `(response_len,)`, from one forward pass."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1 : -1].float()  # (response_len, vocab)
    logprobs = F.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


def _assert_close_to_hf(got: Sequence[float], expected: torch.Tensor) -> None:
    diff = (torch.tensor(got) - expected).abs()
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL, f"mean {diff.mean():.3f}, max {diff.max():.3f}"


def _assert_well_formed(completion: Completion, max_new_tokens: int) -> None:
    assert 0 < len(completion.token_ids) == len(completion.logprobs) <= max_new_tokens
    assert all(torch.isfinite(torch.tensor(completion.logprobs)))
    assert max(completion.logprobs) <= 0


def test_engine_satisfies_protocol(engine: OpenAIEngine, smollm2: Policy) -> None:
    as_protocol: GenerationEngine = engine
    assert as_protocol.generate([], SamplingParams()) == []
    assert engine.tokenizer is smollm2.tokenizer
    assert OpenAIEngine("http://127.0.0.1:8000/v1/").base_url == "http://127.0.0.1:8000"


def test_greedy_matches_hf_engine(engine: OpenAIEngine, smollm2: Policy) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    prompts = _prompts(smollm2)
    served = engine.generate(prompts, params)
    local = HFEngine(smollm2.model, smollm2.tokenizer).generate(prompts, params)
    for prompt, ours, theirs in zip(prompts, served, local, strict=True):
        _assert_well_formed(ours, params.max_new_tokens)
        forced = _teacher_forced_logprobs(smollm2, prompt, ours, 0.0)
        _assert_close_to_hf(ours.logprobs, forced)
        pairs = list(zip(ours.token_ids, theirs.token_ids, strict=False))  # lengths may differ
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        assert same > 0, "the first greedy token differs"
        _assert_close_to_hf(ours.logprobs[:same], torch.tensor(theirs.logprobs[:same]))
        if same < len(pairs):
            # The two numerics may break a near-tie differently; then HF rates the server's
            # token almost as high as its own choice.
            assert theirs.logprobs[same] - forced[same] < MAX_TOL


def test_token_ids_round_trip_through_the_hf_tokenizer(engine: OpenAIEngine, smollm2: Policy, server_url: str) -> None:
    prompt = _prompts(smollm2, ["Write one sentence about the sea."])[0]
    completion = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    # The server's own text for the same greedy request, rendered with its GGUF vocabulary.
    answer = httpx.post(
        f"{server_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
        timeout=60,
    ).json()
    text = smollm2.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert text == answer["choices"][0]["text"]
    assert smollm2.tokenizer.encode(text, add_special_tokens=False) == completion.token_ids


def test_sampled_logprobs_are_at_the_sampling_temperature(engine: OpenAIEngine, smollm2: Policy) -> None:
    params = SamplingParams(temperature=0.7, max_new_tokens=16)
    # Prompts and seed chosen so that the samples stay in ASCII (see the test below).
    prompts = _prompts(smollm2, ["What is 2+2?", "What is 3+5?"])
    for prompt, completion in zip(prompts, engine.generate(prompts, params, seed=0), strict=True):
        _assert_well_formed(completion, params.max_new_tokens)
        _assert_close_to_hf(completion.logprobs, _teacher_forced_logprobs(smollm2, prompt, completion, 0.7))


def test_tokens_without_a_reported_logprob_fail_the_batch(engine: OpenAIEngine, smollm2: Policy) -> None:
    # Greedy SmolLM2 answers in CJK characters, which its vocabulary splits into byte tokens;
    # llama-server reports no log-prob for a token that ends inside a character.
    prompts = _prompts(smollm2, ["Say hello in Chinese."])
    with pytest.raises(ServerError, match="generated 24 tokens but reported log-probs for 8: .* multi-byte"):
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))


def test_batch_keeps_order_and_seeds_each_request(engine: OpenAIEngine, smollm2: Policy) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts = _prompts(smollm2, [TEXTS[0], TEXTS[1], TEXTS[0]])
    first = engine.generate(prompts, params, seed=3)
    assert engine.generate(prompts, params, seed=3) == first
    # Copies of a prompt get seeds 3 and 5, hence different samples (GRPO groups need that).
    assert first[0].token_ids != first[2].token_ids
    for prompt, completion in zip(prompts, first, strict=True):
        # Scored under its own prompt: a completion returned in another request's place fails here.
        _assert_close_to_hf(completion.logprobs, _teacher_forced_logprobs(smollm2, prompt, completion, 1.0))


def test_completions_end_at_a_stop_token_or_the_length_limit(engine: OpenAIEngine, smollm2: Policy) -> None:
    prompts = _prompts(smollm2, [TEXTS[0]])
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40))[0]
    assert done.finish_reason == "stop"
    assert done.token_ids[-1] in engine.stop_ids
    assert engine.stop_ids == [0, 2]  # <|endoftext|>, <|im_end|>
    cut = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert cut.finish_reason == "length"
    assert cut.token_ids == done.token_ids[:4]


def test_should_stop_abandons_the_batch(engine: OpenAIEngine, smollm2: Policy) -> None:
    prompts = _prompts(smollm2) * 2
    params = SamplingParams(temperature=1.0, max_new_tokens=400)
    assert engine.generate(prompts, params, should_stop=lambda: True) is None
    polls = iter(range(1_000_000))
    assert engine.generate(prompts, params, should_stop=lambda: next(polls) >= 3) is None
    # The server dropped the abandoned requests and serves the next batch.
    after = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert after is not None and len(after[0].token_ids) == 4


async def test_generate_blocks_inside_a_running_event_loop(engine: OpenAIEngine, smollm2: Policy) -> None:
    # An async caller's loop is already running; the engine then runs its own loop in a thread.
    completion = engine.generate(_prompts(smollm2, [TEXTS[0]]), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert completion is not None and len(completion[0].token_ids) == 4


def test_server_errors_say_what_to_do(server_url: str, smollm2: Policy) -> None:
    prompts = _prompts(smollm2, [TEXTS[0]])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    closed_port = free_port()
    with pytest.raises(ServerError, match="could not connect .* start the completions server"):
        OpenAIEngine(f"http://127.0.0.1:{closed_port}", server="llama.cpp").generate(prompts, greedy)
    with pytest.raises(ServerError, match="HTTP 404.* base_url must be the root"):
        OpenAIEngine(f"{server_url}/nowhere", server="llama.cpp").generate(prompts, greedy)
    # A real answer to a request without `logprobs`.
    answer = httpx.post(f"{server_url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 2}, timeout=60).json()
    with pytest.raises(ServerError, match="without per-token log-probs"):
        parse_choice(answer["choices"][0])
    with pytest.raises(ValueError, match="top_p=0.9 .* use top_p=1"):
        OpenAIEngine(server_url, server="llama.cpp").generate(prompts, SamplingParams(temperature=0.7, top_p=0.9))


# vLLM's completions answers (vllm/entrypoints/openai protocol, CompletionResponseChoice):
# OpenAI's legacy logprobs shape, with ids in `token_ids` (return_token_ids) or in the token
# strings (return_tokens_as_token_ids).
_VLLM_LOGPROBS = {
    "text_offset": [0, 3, 5],
    "token_logprobs": [-0.5, -1.25, -0.0],
    "tokens": ["token_id:504", "token_id:33", "token_id:2"],
    "top_logprobs": [{"token_id:504": -0.5}, {"token_id:33": -1.25}, {"token_id:2": -0.0}],
}


def test_parse_choice_reads_vllm_answers() -> None:
    with_ids = {
        "index": 0,
        "text": "The 4",
        "token_ids": [504, 33, 2],
        "logprobs": _VLLM_LOGPROBS,
        "finish_reason": "stop",
    }
    assert parse_choice(with_ids) == ([504, 33, 2], [-0.5, -1.25, 0.0], "stop")
    older = {"index": 0, "text": "The 4", "logprobs": _VLLM_LOGPROBS, "finish_reason": "stop"}
    assert parse_choice(older) == ([504, 33, 2], [-0.5, -1.25, 0.0], "stop")
    by_text = {
        "index": 0,
        "logprobs": {**_VLLM_LOGPROBS, "tokens": ["The", " 4", "</s>"]},
        "finish_reason": "stop",
    }
    with pytest.raises(ServerError, match="by its text, not its id"):
        parse_choice(by_text)
    missing = {**with_ids, "logprobs": {**_VLLM_LOGPROBS, "token_logprobs": [-0.5, None, 0.0]}}
    with pytest.raises(ServerError, match="non-finite"):
        parse_choice(missing)


def test_to_completion_keeps_the_first_stop_token_and_drops_the_rest() -> None:
    ids, logprobs = [5, 6, 2, 7], [-1.0, -2.0, -0.5, -3.0]
    assert to_completion(ids, logprobs, "length", [0, 2]) == Completion([5, 6, 2], [-1.0, -2.0, -0.5], "stop")
    assert to_completion(ids, logprobs, "length", []) == Completion(ids, logprobs, "length")
    with pytest.raises(ServerError, match="finish_reason 'abort'"):
        to_completion(ids, logprobs, "abort", [])
