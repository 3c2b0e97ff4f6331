from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trainer_core.engines.hf import HFEngine, SamplingParams
from trainer_core.models.loading import Policy, encode_prompt, load_policy
from trainer_core.models.lora import LoraSettings, apply_lora, causal_lm
from trainer_core.supervised.sft import (
    SFT_CONFIG_FILE,
    SFTConfig,
    SFTExample,
    _encode_examples,
    _response_nll,
    encode_pair,
    end_token_id,
    read_sft_examples,
    run_sft,
    sft_loss,
    train_sft,
)

MAPPING = [
    SFTExample("a?", "apple"),
    SFTExample("b?", "banana"),
    SFTExample("c?", "cherry"),
    SFTExample("d?", "date"),
]


def _greedy(policy: Policy, prompts: list[str]) -> list[tuple[str, str]]:
    engine = HFEngine(policy.model, policy.tokenizer)
    completions = engine.generate(
        [encode_prompt(policy.tokenizer, p) for p in prompts], SamplingParams(temperature=0, max_new_tokens=12)
    )
    assert completions is not None
    return [(policy.tokenizer.decode(c.token_ids, skip_special_tokens=True), c.finish_reason) for c in completions]


def test_sft_learns_a_fixed_mapping(tiny_policy: Policy) -> None:
    cfg = SFTConfig(learning_rate=3e-3, epochs=60, batch_size=4, micro_batch_size=2)
    before = sft_loss(tiny_policy, MAPPING, cfg)

    metrics = train_sft(tiny_policy, MAPPING, cfg)

    after = sft_loss(tiny_policy, MAPPING, cfg)
    assert before > 4.0  # about log(vocab = 98) for the untrained model
    assert after < 0.05
    assert metrics["sft/steps"] == 60
    assert metrics["sft/loss"] < 0.1
    assert metrics["data/examples"] == 4 and metrics["data/dropped"] == 0
    # The end token is trained too: each reply stops on it.
    assert _greedy(tiny_policy, [e.prompt for e in MAPPING]) == [(e.response, "stop") for e in MAPPING]


def test_sft_is_deterministic_for_a_seed(model_cache: Path) -> None:
    # batch_size 2 of 4 examples: the seeded shuffle decides which pairs share a step.
    cfg = SFTConfig(learning_rate=1e-3, epochs=2, batch_size=2, micro_batch_size=1, seed=7)
    runs = []
    for _ in range(2):
        policy = load_policy("tiny", cache_dir=model_cache)
        metrics = train_sft(policy, MAPPING, cfg)
        runs.append((metrics["sft/loss"], policy.model.state_dict()))
    (loss_a, weights_a), (loss_b, weights_b) = runs
    assert loss_a == loss_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)

    other = load_policy("tiny", cache_dir=model_cache)
    train_sft(other, MAPPING, dataclasses.replace(cfg, seed=8))
    assert not all(torch.equal(weights_a[k], v) for k, v in other.model.state_dict().items())


def test_sft_of_a_lora_policy_trains_only_the_adapter(tiny_policy: Policy) -> None:
    base = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    tiny_policy.model = apply_lora(tiny_policy.model, LoraSettings(rank=8))
    cfg = SFTConfig(learning_rate=1e-2, epochs=10, batch_size=4)
    before = sft_loss(tiny_policy, MAPPING, cfg)

    train_sft(tiny_policy, MAPPING, cfg)

    assert sft_loss(tiny_policy, MAPPING, cfg) < before - 0.5
    frozen = causal_lm(tiny_policy.model)
    assert all(
        torch.equal(p, base[name.replace("base_layer.", "")])
        for name, p in frozen.named_parameters()
        if "lora_" not in name
    )


def test_loss_is_over_response_tokens_only(tiny_policy: Policy) -> None:
    """The SFT loss equals transformers' own loss with the prompt's labels ignored (-100), and
    not the loss that also counts the prompt tokens' targets."""
    cfg = SFTConfig()
    example = SFTExample("what is red?", "a rose")
    prompt_ids = encode_prompt(tiny_policy.tokenizer, example.prompt)
    input_ids = torch.tensor(
        [prompt_ids + tiny_policy.tokenizer.encode(example.response) + [tiny_policy.tokenizer.eos_token_id]]
    )
    masked = input_ids.clone()
    masked[0, : len(prompt_ids)] = -100

    with torch.no_grad():
        want = tiny_policy.model(input_ids=input_ids, labels=masked).loss.item()
        with_prompt = tiny_policy.model(input_ids=input_ids, labels=input_ids).loss.item()

    got = sft_loss(tiny_policy, [example], cfg)
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(with_prompt - want) > 0.01  # the two readings differ, so the check above can fail


def test_no_prompt_position_reaches_the_lm_head(tiny_policy: Policy) -> None:
    """The LM head sees one row per response token (end token included) and none for prompt
    positions, so no prompt token's target can enter the loss."""
    rows = []
    head = tiny_policy.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    try:
        examples = [SFTExample("a long prompt here", "ok"), SFTExample("x", "yes")]
        sft_loss(tiny_policy, examples, SFTConfig())
    finally:
        handle.remove()
    # "ok" + end token and "yes" + end token: 3 + 4 rows, none for the 19 prompt characters.
    assert sum(rows) == 3 + 4


def test_packed_padded_and_single_sequence_losses_agree(tiny_policy: Policy) -> None:
    """Packing sequences into one row (block-diagonal attention from position_ids) gives the
    per-token losses of right-padded rows and of each sequence alone."""
    examples = [SFTExample("short", "x"), SFTExample("a longer prompt", "a longer reply"), SFTExample("q", "mid")]
    encoded, _, _ = _encode_examples(tiny_policy.tokenizer, examples, max_len=64)
    cfg = SFTConfig()
    with torch.no_grad():
        packed = _response_nll(tiny_policy.model, encoded, cfg)
        padded = _response_nll(tiny_policy.model, encoded, dataclasses.replace(cfg, packed=False))
        single = torch.cat([_response_nll(tiny_policy.model, [e], cfg) for e in encoded])
    assert packed.shape == (1 + 1 + 14 + 1 + 3 + 1,)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-5)


def test_max_len_truncates_responses_and_drops_long_prompts(tiny_policy: Policy) -> None:
    examples = [SFTExample("ab", "cdefgh"), SFTExample("a prompt longer than max_len", "x")]
    encoded, truncated, dropped = _encode_examples(tiny_policy.tokenizer, examples, max_len=5)
    assert (truncated, dropped) == (1, 1)
    assert len(encoded) == 1 and len(encoded[0].ids) == 5 and encoded[0].n_prompt == 2


def test_run_sft_reads_jsonl_and_saves_a_loadable_policy(tmp_path: Path, model_cache: Path) -> None:
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in MAPPING))
    out = tmp_path / "policy"

    metrics = run_sft("tiny", data, out, SFTConfig(learning_rate=1e-3, batch_size=4), cache_dir=model_cache)

    record = json.loads((out / SFT_CONFIG_FILE).read_text())
    assert record["metrics"] == metrics and record["config"]["batch_size"] == 4
    base = load_policy("tiny", cache_dir=model_cache)
    reloaded = load_policy(out, cache_dir=model_cache)
    assert sft_loss(reloaded, MAPPING, SFTConfig()) < sft_loss(base, MAPPING, SFTConfig())


def test_end_token_is_the_one_the_chat_template_closes_a_reply_with(tiny_policy: Policy) -> None:
    tokenizer = tiny_policy.tokenizer
    assert end_token_id(tokenizer) == tokenizer.eos_token_id  # no chat template: eos
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_token_id(tokenizer) == im_end
    prompt_ids, response_ids = encode_pair(tokenizer, "hi", "yo")
    assert tokenizer.decode(prompt_ids) == "user: hi<|im_end|>\nassistant: "
    assert response_ids == [*tokenizer.encode("yo"), im_end]


def test_read_sft_examples_names_the_bad_line(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n\n{"prompt": "p"}\n')
    with pytest.raises(ValueError, match="line 3"):
        read_sft_examples(data)
    data.write_text('{"prompt": "p", "response": "r"}\n')
    assert read_sft_examples(data) == [SFTExample("p", "r")]
