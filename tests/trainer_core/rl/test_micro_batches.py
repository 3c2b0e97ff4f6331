"""Micro-batch planning: the split of a mini-batch, and the auto size (micro_batch 0) from free
memory with its trial pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.memory import plan_micro_batch
from trainer_core.models.loading import Policy
from trainer_core.rl import micro_batches
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.micro_batches import _trial_pass
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch


def _random_samples(make_sample: Callable[..., Sample], vocab: int, n: int) -> list[Sample]:
    """`n` samples of random prompts and responses of 1 to 11 tokens, in groups of 2."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        n_prompt, n_response = (int(x) for x in torch.randint(1, 12, (2,), generator=gen))
        samples.append(
            make_sample(
                prompt_ids=torch.randint(3, vocab, (n_prompt,), generator=gen).tolist(),
                response_ids=torch.randint(3, vocab, (n_response,), generator=gen).tolist(),
                logprobs=[-4.6] * n_response,
                reward=float(i % 2),
                group_id=f"g{i // 2}",
            )
        )
    return samples


def test_a_mini_batch_splits_into_runs_of_micro_batch_samples(make_sample: Callable[..., Sample]) -> None:
    samples = _random_samples(make_sample, 50, n=8)
    batches = micro_batches.micro_batches(samples, range(2, 7), TrainConfig(micro_batch=2), None)
    assert batches == [[2, 3], [4, 5], [6]]


def test_auto_micro_batch_plans_from_free_memory_on_cpu(
    tiny_policy: Policy, make_sample: Callable[..., Sample], monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer), n=8)
    model = tiny_policy.model
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    # Free memory for ~3 micro-batch units of this model by the rule of thumb.
    tight = 3.5 * billions * 2 * 3 / 0.6
    monkeypatch.setattr(micro_batches, "available_memory_gb", lambda device: tight)
    assert micro_batches.auto_micro_batch(model, samples, TrainConfig(micro_batch=0)) == 3
    assert plan_micro_batch(device_memory_gb=tight, params_billions=billions) == 3
    monkeypatch.setattr(micro_batches, "available_memory_gb", lambda device: 1e6)
    assert micro_batches.auto_micro_batch(model, samples, TrainConfig()) == len(samples), "never more than the batch"
    with pytest.raises(ValueError, match="auto_micro_batch"):
        train_on_batch(model, samples, TrainConfig(micro_batch=0), build_optimizer(model, TrainConfig()))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_trial_pass_leaves_no_gradient_and_no_change(
    tiny_policy: Policy, make_sample: Callable[..., Sample], algorithm: str
) -> None:
    model = tiny_policy.model
    value_head = ValueHead(model.config.hidden_size) if algorithm == "ppo" else None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reached = []
    model.model.layers[0].mlp.down_proj.weight.register_hook(lambda grad: reached.append(grad.abs().sum().item()))
    _trial_pass(
        model,
        _random_samples(make_sample, len(tiny_policy.tokenizer), n=4),
        TrainConfig(algorithm=algorithm),
        value_head,
    )
    assert reached and reached[0] > 0, "the backward pass ran through the first layer"
    assert all(p.grad is None for p in model.parameters())
    assert value_head is None or all(p.grad is None for p in value_head.parameters())
    assert not model.training, "back in eval mode, ready to generate"
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
