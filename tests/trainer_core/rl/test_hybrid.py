"""The hybrid engine of colocated runs: one copy of the weights for generation and training."""

from __future__ import annotations

from collections.abc import Callable

import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.engines.hf import SamplingParams
from trainer_core.models.loading import Policy, encode_prompt
from trainer_core.rl.hybrid import HybridEngine


def test_the_hybrid_engine_holds_one_copy_of_the_weights(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    policy = tiny_policy
    engine = HybridEngine(policy, TrainConfig(learning_rate=1e-2))
    assert engine.rollout._model is engine.model is policy.model
    storage = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}

    prompt = encode_prompt(policy.tokenizer, "say a:")
    torch.manual_seed(0)
    completions = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=6))
    assert not engine.model.training
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == storage
    samples = [make_sample(prompt, c.token_ids, c.logprobs, float(i % 2), "g") for i, c in enumerate(completions)]
    engine.train(samples)
    assert not engine.model.training
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == storage
    # Updated in place: the rollout side sees the new weights without any reload.
    assert any(not torch.equal(p, before[name]) for name, p in engine.rollout._model.named_parameters())


def test_an_auto_micro_batch_is_sized_on_the_first_batch(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    policy = tiny_policy
    engine = HybridEngine(policy, TrainConfig(micro_batch=0))
    prompt = encode_prompt(policy.tokenizer, "say a:")
    completions = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=6))
    engine.train([make_sample(prompt, c.token_ids, c.logprobs, float(i % 2), "g") for i, c in enumerate(completions)])
    assert engine.cfg.micro_batch == 4  # the whole batch: the tiny model fits many times over
