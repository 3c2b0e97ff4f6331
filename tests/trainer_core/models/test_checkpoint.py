from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.engines.hf import HFEngine, SamplingParams
from trainer_core.models import checkpoint as ckpt
from trainer_core.models.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from trainer_core.models.loading import Policy, encode_prompt, load_policy
from trainer_core.models.lora import is_lora
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch

PROMPTS = ("say a:", "aaa?", "b then a", "a!")


def _train(
    policy: Policy,
    train_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    value_head: ValueHead | None,
    make_sample: Callable[..., Sample],
    steps: int,
) -> None:
    """`steps` iterations of: pick 2 prompts (python RNG), sample 4 completions of each (torch
    RNG), reward the fraction of "a" tokens, update."""
    engine = HFEngine(train_model, policy.tokenizer)
    a = policy.tokenizer.convert_tokens_to_ids("a")
    for _ in range(steps):
        texts = random.sample(PROMPTS, 2)
        prompts = [encode_prompt(policy.tokenizer, t) for t in texts for _ in range(4)]
        completions = engine.generate(prompts, SamplingParams(max_new_tokens=6))
        samples = [
            make_sample(p, c.token_ids, c.logprobs, sum(t == a for t in c.token_ids) / len(c.token_ids), f"g{i // 4}")
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        train_on_batch(train_model, samples, cfg, optimizer, value_head=value_head)


def _state(model: nn.Module, value_head: ValueHead | None) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if value_head is not None:
        state.update({f"value_head.{k}": v.clone() for k, v in value_head.state_dict().items()})
    return state


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == []


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_trains_to_the_same_weights_as_training_straight(
    model_cache: Path, tmp_path: Path, make_sample: Callable[..., Sample], algorithm: str
) -> None:
    cfg = TrainConfig(algorithm=algorithm, learning_rate=1e-2, micro_batch=8)

    def fresh() -> tuple[Policy, ValueHead | None, torch.optim.Optimizer]:
        policy = load_policy("tiny", cache_dir=model_cache)
        value_head = ValueHead(policy.model.config.hidden_size) if algorithm == "ppo" else None
        return policy, value_head, build_optimizer(policy.model, cfg, value_head)

    _seed(7)
    policy, value_head, optimizer = fresh()
    _train(policy, policy.model, optimizer, cfg, value_head, make_sample, steps=3)
    straight = _state(policy.model, value_head)

    _seed(7)
    policy, value_head, optimizer = fresh()
    _train(policy, policy.model, optimizer, cfg, value_head, make_sample, steps=1)
    path = save_checkpoint(tmp_path, 1, policy=policy, optimizer=optimizer, value_head=value_head, config=cfg)
    del policy, value_head, optimizer
    _seed(12345)  # whatever the process drew meanwhile is undone by the load

    policy, value_head, optimizer = fresh()
    state = load_checkpoint(path, policy_or_model=policy, optimizer=optimizer, value_head=value_head)
    assert state.step == 1 and state.config == cfg.model_dump(mode="json")
    _train(policy, policy.model, optimizer, cfg, value_head, make_sample, steps=2)
    _assert_same(_state(policy.model, value_head), straight)
    assert {p.name for p in (path / "policy").iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}


def _tiny_with_lora(model_cache: Path) -> Policy:
    from peft import LoraConfig, get_peft_model

    policy = load_policy("tiny", cache_dir=model_cache)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    policy.model = get_peft_model(policy.model, config)
    return policy


def _lora_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_lora_checkpoint_holds_only_the_adapter_and_resumes(
    model_cache: Path, tmp_path: Path, make_sample: Callable[..., Sample]
) -> None:
    from safetensors.torch import load_file

    cfg = TrainConfig(learning_rate=1e-2, micro_batch=8)

    def fresh() -> tuple[Policy, torch.optim.Optimizer]:
        policy = _tiny_with_lora(model_cache)
        return policy, build_optimizer(policy.model, cfg)

    def train(policy: Policy, optimizer: torch.optim.Optimizer, steps: int) -> None:
        # The transformers model inside the peft wrapper, adapter layers injected.
        _train(policy, policy.model.get_base_model(), optimizer, cfg, None, make_sample, steps)

    _seed(3)
    policy, optimizer = fresh()
    train(policy, optimizer, 2)
    straight = _lora_weights(policy.model)
    base = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}

    _seed(3)
    policy, optimizer = fresh()
    train(policy, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, policy=policy, optimizer=optimizer)

    saved = load_file(path / "policy" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert not (path / "policy" / "model.safetensors").exists()
    full = tmp_path / "full"
    policy.model.get_base_model().save_pretrained(full)
    adapter_bytes = (path / "policy" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes * 10 < (full / "model.safetensors").stat().st_size

    # Into a fresh adapter (peft initialises lora_A at random, so it differs until loaded).
    policy, optimizer = fresh()
    assert _lora_weights(policy.model).keys() == straight.keys()
    state = load_checkpoint(path, policy_or_model=policy, optimizer=optimizer)
    assert state.model is policy.model
    train(policy, optimizer, 1)
    _assert_same(_lora_weights(policy.model), straight)
    _assert_same({k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}, base)

    # Into a plain base model: the adapter is applied to it.
    plain = load_policy("tiny", cache_dir=model_cache)
    with pytest.raises(ValueError, match="optimizer=None"):
        load_checkpoint(path, policy_or_model=plain, optimizer=build_optimizer(plain.model, cfg))
    state = load_checkpoint(path, policy_or_model=plain)
    assert plain.model is state.model and is_lora(state.model)
    loaded = {k.replace(".default", ""): v for k, v in _lora_weights(state.model).items()}
    _assert_same(loaded, {k.replace(".default", ""): v for k, v in saved.items()})


def test_rotation_keeps_the_last_three(tiny_policy: Policy, tmp_path: Path) -> None:
    optimizer = build_optimizer(tiny_policy.model, TrainConfig())
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, policy=tiny_policy, optimizer=optimizer, metadata={"i": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000005"

    # Saving an existing step again replaces it.
    save_checkpoint(tmp_path, 5, policy=tiny_policy, optimizer=optimizer, metadata={"i": "again"})
    assert load_checkpoint(tmp_path / "step-00000005", policy_or_model=tiny_policy).metadata == {"i": "again"}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004", "step-00000005"]


def test_an_interrupted_save_is_ignored_and_cleaned_up(
    tiny_policy: Policy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    optimizer = build_optimizer(tiny_policy.model, TrainConfig())
    first = save_checkpoint(tmp_path, 1, policy=tiny_policy, optimizer=optimizer)

    # A process killed just before the rename: everything written, nothing cleaned up.
    def killed(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "rename", killed)
        m.setattr(ckpt.shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path, 2, policy=tiny_policy, optimizer=optimizer)
    (leftover,) = [p for p in tmp_path.iterdir() if p != first]
    assert leftover.name.startswith(".tmp-step-00000002") and (leftover / "meta.json").is_file()
    assert latest_checkpoint(tmp_path) == first

    # An ordinary failure cleans up its own temp dir; the next save removes the dead one.
    with monkeypatch.context() as m:
        m.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(tmp_path, 2, policy=tiny_policy, optimizer=optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, leftover.name])
    second = save_checkpoint(tmp_path, 2, policy=tiny_policy, optimizer=optimizer)
    assert sorted(tmp_path.iterdir()) == [first, second]


def test_loading_what_a_checkpoint_lacks_is_an_error(tiny_policy: Policy, tmp_path: Path) -> None:
    optimizer = build_optimizer(tiny_policy.model, TrainConfig())
    path = save_checkpoint(tmp_path, 0, policy=tiny_policy.model, optimizer=optimizer)
    with pytest.raises(ValueError, match="no value head"):
        load_checkpoint(path, policy_or_model=tiny_policy, value_head=ValueHead(64))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "step-00000009", policy_or_model=tiny_policy)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, policy=tiny_policy, optimizer=optimizer, keep=0)
