from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer_core.engines.hf import Completion, GenerationEngine, HFEngine, SamplingParams
from trainer_core.models.loading import Policy, encode_prompt, load_policy

# Different lengths, so the batch is left-padded.
TEXTS = ("a", "hello there", "What is 2+2?\n")


def _prompts(policy: Policy) -> list[list[int]]:
    return [encode_prompt(policy.tokenizer, text) for text in TEXTS]


def _teacher_forced_logprobs(
    model: nn.Module, prompt: list[int], completion: Completion, temperature: float
) -> torch.Tensor:
    """Log-probs of the completion's tokens from one plain forward pass over prompt + completion."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (response_len, vocab)
    logprobs = F.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


def _favour_eos(policy: Policy, bias: float) -> None:
    """Give the lm_head a bias towards eos, so that sequences stop after a few tokens."""
    old = policy.model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[policy.tokenizer.eos_token_id] = bias
    policy.model.lm_head = head


def test_engine_satisfies_protocol(tiny_policy: Policy) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    as_protocol: GenerationEngine = engine
    assert as_protocol.generate([], SamplingParams()) == []
    assert engine.tokenizer is tiny_policy.tokenizer


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=12),
        SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=12),
        SamplingParams(temperature=0.0, max_new_tokens=12),
    ],
    ids=["t1", "t0.7-top_p", "greedy"],
)
def test_logprobs_match_a_teacher_forced_pass(tiny_policy: Policy, params: SamplingParams) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    prompts = _prompts(tiny_policy)
    completions = engine.generate(prompts, params, seed=0)
    assert len(completions) == len(prompts)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(completion.token_ids) == len(completion.logprobs) == params.max_new_tokens
        expected = _teacher_forced_logprobs(tiny_policy.model, prompt, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_bf16_autocast_records_its_own_logprobs_near_fp32_ones(tiny_policy: Policy) -> None:
    """Under bf16 autocast (on by default on CUDA only) the recorded log-probs are the bf16
    sampler's: near the fp32 policy's log-probs of the same tokens, yet not equal to them."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = _prompts(tiny_policy)
    fp32 = HFEngine(tiny_policy.model, tiny_policy.tokenizer).generate(prompts, params, seed=0)
    assert fp32 == HFEngine(tiny_policy.model, tiny_policy.tokenizer, autocast_bf16=False).generate(
        prompts, params, seed=0
    )
    bf16 = HFEngine(tiny_policy.model, tiny_policy.tokenizer, autocast_bf16=True).generate(prompts, params, seed=0)
    gaps = []
    for prompt, completion in zip(prompts, bf16, strict=True):
        exact = _teacher_forced_logprobs(tiny_policy.model, prompt, completion, params.temperature)
        gaps.append((torch.tensor(completion.logprobs) - exact).abs().max().item())
    assert 0 < max(gaps) < 0.1, gaps


def test_greedy_is_deterministic_and_independent_of_batch_padding(tiny_policy: Policy) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    prompts = _prompts(tiny_policy)
    batched = engine.generate(prompts, params)
    assert engine.generate(prompts, params) == batched
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched]


def test_seeded_sampling_is_reproducible(tiny_policy: Policy) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    prompts = _prompts(tiny_policy) * 2
    params = SamplingParams(max_new_tokens=16)
    first = engine.generate(prompts, params, seed=7)
    assert engine.generate(prompts, params, seed=7) == first
    assert engine.generate(prompts, params, seed=8) != first


def test_each_sequence_stops_at_its_own_stop_token(tiny_policy: Policy) -> None:
    _favour_eos(tiny_policy, bias=3.0)
    eos = tiny_policy.tokenizer.eos_token_id
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    prompts = _prompts(tiny_policy) * 4
    params = SamplingParams(max_new_tokens=10)
    completions = engine.generate(prompts, params, seed=3)

    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}  # the bias makes both happen in this batch
    assert len({len(c.token_ids) for c in completions}) > 2
    for prompt, completion in zip(prompts, completions, strict=True):
        assert eos not in completion.token_ids[:-1]
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == eos
        else:
            assert len(completion.token_ids) == params.max_new_tokens and eos not in completion.token_ids
        expected = _teacher_forced_logprobs(tiny_policy.model, prompt, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_all_stopped_ends_early(tiny_policy: Policy) -> None:
    _favour_eos(tiny_policy, bias=100.0)
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    calls = 0

    def should_stop() -> bool:
        nonlocal calls
        calls += 1
        return False

    completions = engine.generate(_prompts(tiny_policy), SamplingParams(max_new_tokens=50), should_stop=should_stop)
    assert [c.token_ids for c in completions] == [[tiny_policy.tokenizer.eos_token_id]] * len(TEXTS)
    assert {c.finish_reason for c in completions} == {"stop"}
    assert calls == 1


def test_should_stop_abandons_the_batch(tiny_policy: Policy) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    calls = 0

    def should_stop() -> bool:
        nonlocal calls
        calls += 1
        return calls == 3

    assert engine.generate(_prompts(tiny_policy), SamplingParams(max_new_tokens=50), should_stop=should_stop) is None
    assert calls == 3  # checked before every step, and nothing after the abort


def test_set_model_switches_weights_and_mode_is_restored(tiny_policy: Policy, model_cache: Path) -> None:
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = _prompts(tiny_policy)
    before = engine.generate(prompts, params)

    other = load_policy("tiny", cache_dir=model_cache).model
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    other.train()
    engine.set_model(other)
    after = engine.generate(prompts, params)
    assert after != before
    assert other.training  # generation ran in eval mode, then gave the caller's mode back


def test_sampling_params_are_validated() -> None:
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_inverse_cdf_draws_follow_the_distribution() -> None:
    from trainer_core.engines.hf import _draw

    # Unnormalised, with zero-probability entries first, in the middle and last (as top-p leaves them).
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.1, 0.0]).repeat(20_000, 1)
    tokens = _draw(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert counts[[0, 2, 5]].sum() == 0
    # Binomial standard error at n = 20000 is <= 0.0036: 5 sigma.
    torch.testing.assert_close(counts[[1, 3, 4]], torch.tensor([0.25, 0.625, 0.125]), atol=0.018, rtol=0)
