"""LoRA policies (reference = disabled adapter) and the hybrid engine: one copy of the weights
serves generation and training."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.engines.hf import HFEngine, SamplingParams
from trainer_core.memory import frozen_parameter_audit
from trainer_core.models.loading import Policy, encode_prompt
from trainer_core.models.lora import (
    LoraSettings,
    apply_lora,
    causal_lm,
    check_only_adapter_trains,
    is_lora,
    reference_policy,
)
from trainer_core.rl.batch import _score
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch


def _samples(policy: Policy, make_sample: Callable[..., Sample], model: torch.nn.Module, seed: int = 0) -> list[Sample]:
    """8 samples of 2 prompts, drawn from `model`, with rewards that differ within each group."""
    engine = HFEngine(model, policy.tokenizer)
    prompts = [encode_prompt(policy.tokenizer, text) for text in ("ab:", "cd?") for _ in range(4)]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=6), seed=seed)
    return [
        make_sample(
            prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs, reward=float(i % 2), group_id=f"g{i // 4}"
        )
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


def test_lora_trains_only_the_adapter_with_the_base_as_reference(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    base = copy.deepcopy(tiny_policy.model)
    model = apply_lora(tiny_policy.model, LoraSettings(rank=4, alpha=8))
    assert is_lora(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert frozen_parameter_audit(model, trainable) == []

    samples = _samples(tiny_policy, make_sample, model)
    cfg = TrainConfig(kl_coef=0.1, learning_rate=1e-2)
    optimizer = build_optimizer(model, cfg)
    first = train_on_batch(model, samples, cfg, optimizer)  # no ref_model: the disabled adapter is the reference
    second = train_on_batch(model, samples, cfg, optimizer)
    # LoRA's B starts at zero, so the policy starts equal to its reference; after a step it is not.
    assert first["actor/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert second["actor/kl_ref"] > 1e-6

    # The base weights did not move; the disabled adapter scores exactly as the base model does.
    for name, p in causal_lm(model).named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base.get_parameter(name.replace(".base_layer", ""))), name
    with torch.no_grad(), reference_policy(model, None) as ref:
        ref_logprob = _score(ref, samples, 6, cfg)
    with torch.no_grad():
        torch.testing.assert_close(ref_logprob, _score(base, samples, 6, cfg))
        assert not torch.allclose(_score(model, samples, 6, cfg), ref_logprob)


def test_gradient_checkpointing_gives_the_same_update(tiny_policy: Policy, make_sample: Callable[..., Sample]) -> None:
    samples = _samples(tiny_policy, make_sample, tiny_policy.model)
    updated = []
    for checkpointing in (False, True):
        model = copy.deepcopy(tiny_policy.model)
        cfg = TrainConfig(gradient_checkpointing=checkpointing, micro_batch=4)
        train_on_batch(model, samples, cfg, torch.optim.SGD(model.parameters(), lr=0.1))
        # Ready to generate again: eval mode, no layer checkpointed.
        assert not model.training
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        updated.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class _NewStorageBytes(TorchDispatchMode):
    """Counts the bytes of every new tensor storage that an op creates inside the block."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = set(known)
        self.bytes = 0
        self.largest = 0  # the largest new storage: unlike the sum, independent of address reuse

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@contextmanager
def _count_new_storage(model: torch.nn.Module) -> Iterator[_NewStorageBytes]:
    with _NewStorageBytes({p.untyped_storage().data_ptr() for p in model.parameters()}) as counter:
        yield counter


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_switching_modes_holds_no_second_copy_of_the_weights(
    tiny_policy: Policy, make_sample: Callable[..., Sample], lora: bool
) -> None:
    """Weights big next to activations (2 layers of 256 x 1024): a second copy made for
    generation (a bf16 cast, a merged adapter, a deepcopy) would allocate MBs."""
    config = LlamaConfig(
        vocab_size=len(tiny_policy.tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=tiny_policy.tokenizer.pad_token_id,
        eos_token_id=tiny_policy.tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if lora:
        model = apply_lora(model, LoraSettings(rank=4, alpha=8))
    weight_bytes = sum(p.nbytes for p in model.parameters())
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    engine = HFEngine(model, tiny_policy.tokenizer)
    samples = _samples(tiny_policy, make_sample, model)
    cfg = TrainConfig(micro_batch=8)
    optimizer = build_optimizer(model, cfg)
    train_on_batch(model, samples, cfg, optimizer)  # optimizer state exists from here on

    with _count_new_storage(model) as counter:
        engine.generate([samples[0].prompt_ids], SamplingParams(max_new_tokens=8), seed=1)
    # A copy of any weight matrix (a bf16 cast, a merged adapter, a deepcopy) would be one storage
    # at least as large as the smallest of them; the sum of new storages is a second, looser
    # bound (it varies a little with how the allocator reuses freed addresses).
    smallest_matrix = min(p.nbytes for name, p in model.named_parameters() if p.dim() == 2 and "lora_" not in name)
    assert counter.largest < smallest_matrix, (counter.largest, smallest_matrix)
    assert counter.bytes < 0.1 * weight_bytes, (counter.bytes, weight_bytes)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    # Back to training after generating: same storages, the update still lands on them.
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    train_on_batch(model, samples, cfg, optimizer)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    after = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_an_adaptive_kl_controller_sets_and_adapts_the_coefficient(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    from trainer_core.algos import AdaptiveKLController

    model = apply_lora(tiny_policy.model, LoraSettings(rank=4, alpha=8))
    samples = _samples(tiny_policy, make_sample, model)
    cfg = TrainConfig(learning_rate=1e-2)
    optimizer = build_optimizer(model, cfg)
    # The first update starts at the reference (KL 0, below target): the coefficient shrinks.
    # After it the KL is far above the tiny target: the coefficient grows again.
    controller = AdaptiveKLController(init_coef=0.1, target=1e-9, horizon=100)
    first = train_on_batch(model, samples, cfg, optimizer, kl_controller=controller)
    second = train_on_batch(model, samples, cfg, optimizer, kl_controller=controller)
    assert first["actor/kl_ref"] == 0 and first["actor/kl_coef"] < 0.1
    assert second["actor/kl_ref"] > 0 and second["actor/kl_coef"] == controller.value > first["actor/kl_coef"]


def test_the_freeze_audit_stops_a_lora_run_that_would_train_base_weights(tiny_policy: Policy) -> None:
    model = apply_lora(tiny_policy.model, LoraSettings(rank=4))
    check_only_adapter_trains(model)  # peft froze the base
    base = next(p for name, p in model.named_parameters() if "lora_" not in name and "layers.0" in name)
    base.requires_grad_(True)
    with pytest.raises(ValueError, match="outside the LoRA adapter require grad"):
        check_only_adapter_trains(model)
