from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from contracts.model_sources import RM_CONFIG_FILE, check_reward_model_dir
from trainer_core.models.loading import Policy
from trainer_core.supervised.reward_model import (
    PreferencePair,
    RewardModel,
    RewardModelConfig,
    bradley_terry_loss,
    evaluate_reward_model,
    read_preference_pairs,
    run_train_rm,
    train_reward_model,
)

TRAIN_WORDS = ["cat", "dog", "sun", "tree", "blue", "red", "fish", "car", "hat", "cup"]
HELD_OUT_WORDS = ["moon", "bird", "lamp", "rock", "gold", "snow"]


def yes_no_pairs(words: list[str], n: int, seed: int) -> list[PreferencePair]:
    """Preferences where the chosen reply says "yes" and the rejected one "no", after the same
    filler word; prompts and fillers come from `words`."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = " ".join(rng.sample(words, 2)) + "?"
        filler = rng.choice(words)
        pairs.append(PreferencePair(prompt, f"{filler} yes", f"{filler} no"))
    return pairs


def test_bradley_terry_loss_known_values() -> None:
    loss, metrics = bradley_terry_loss(torch.tensor([0.3, -1.0]), torch.tensor([0.3, -1.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # 0.6931
    assert metrics["rm/accuracy"].item() == 0.0  # ties are not ranked correctly
    assert metrics["rm/margin"].item() == 0.0

    loss, metrics = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]))
    # -log sigmoid(2) = log(1 + e^-2); -log sigmoid(-1) = log(1 + e)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-2)) + math.log1p(math.e)) / 2, abs=1e-6)
    assert metrics["rm/accuracy"].item() == 0.5
    assert metrics["rm/margin"].item() == pytest.approx(0.5)


def test_reward_model_learns_a_synthetic_preference(tiny_policy: Policy) -> None:
    rm = RewardModel.from_policy(tiny_policy, max_len=64)
    train = yes_no_pairs(TRAIN_WORDS, 64, seed=0)
    held_out = yes_no_pairs(HELD_OUT_WORDS, 32, seed=1)
    before = evaluate_reward_model(rm, held_out)

    metrics = train_reward_model(
        rm, train, RewardModelConfig(learning_rate=3e-4, epochs=3, batch_size=8, micro_batch_size=4)
    )

    after = evaluate_reward_model(rm, held_out)
    assert metrics["rm/steps"] == 3 * 64 / 8
    assert after["rm/accuracy"] > 0.9
    assert after["rm/loss"] < before["rm/loss"] - 0.3
    assert after["rm/margin"] > 0
    scores = rm.score(["moon bird?", "moon bird?"], ["rock yes", "rock no"])
    assert scores[0] > scores[1]


def test_save_load_round_trip_gives_identical_scores(tiny_policy: Policy, tmp_path: Path) -> None:
    rm = RewardModel.from_policy(tiny_policy, max_len=32)
    pairs = yes_no_pairs(TRAIN_WORDS, 6, seed=2)
    prompts, responses = [p.prompt for p in pairs], [p.chosen for p in pairs]
    # A few steps, so the saved backbone differs from the base model's.
    train_reward_model(rm, pairs, RewardModelConfig(learning_rate=1e-3, batch_size=3))

    rm.save(tmp_path / "rm", extra={"note": "test"})
    loaded = RewardModel.load(tmp_path / "rm")

    assert loaded.max_len == 32
    assert loaded.score(prompts, responses) == rm.score(prompts, responses)
    assert check_reward_model_dir(tmp_path / "rm")["note"] == "test"


def test_scores_do_not_depend_on_batching(tiny_policy: Policy) -> None:
    """Packed, right-padded and one-at-a-time scoring agree (the head reads each sequence's own
    last token)."""
    rm = RewardModel.from_policy(tiny_policy)
    prompts = ["a", "a much longer prompt", "mid size"]
    responses = ["yes", "no", "a somewhat longer reply"]
    sequences = [rm.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
    with torch.no_grad():
        packed = rm(sequences, packed=True)
        padded = rm(sequences, packed=False)
    single = torch.tensor([rm.score([p], [r])[0] for p, r in zip(prompts, responses, strict=True)])
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-5)
    assert torch.tensor(rm.score(prompts, responses, micro_batch_size=2)).allclose(packed, atol=1e-5)


def test_long_sequences_keep_their_end(tiny_policy: Policy) -> None:
    rm = RewardModel.from_policy(tiny_policy, max_len=8)
    ids = rm.encode("a prompt far longer than eight tokens", "reply")
    assert len(ids) == 8
    assert ids[-1] == tiny_policy.tokenizer.eos_token_id
    # The prompt's start is cut, not the reply or its end token, where the score is read.
    assert tiny_policy.tokenizer.decode(ids[:-1]) == "nsreply"


def test_check_reward_model_dir_refuses_other_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a saved reward model"):
        check_reward_model_dir(tmp_path)
    (tmp_path / RM_CONFIG_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a spotrl.reward_model"):
        check_reward_model_dir(tmp_path)


def test_run_train_rm_from_jsonl(tmp_path: Path, model_cache: Path) -> None:
    def write(path: Path, pairs: list[PreferencePair]) -> Path:
        path.write_text("".join(json.dumps(p.__dict__) + "\n" for p in pairs))
        return path

    train = write(tmp_path / "train.jsonl", yes_no_pairs(TRAIN_WORDS, 16, seed=3))
    held_out = write(tmp_path / "eval.jsonl", yes_no_pairs(HELD_OUT_WORDS, 8, seed=4))
    cfg = RewardModelConfig(learning_rate=1e-3, batch_size=8, max_len=64)

    metrics = run_train_rm("tiny", train, tmp_path / "rm", cfg, cache_dir=model_cache, eval_data=held_out)

    assert {"rm/loss", "rm/accuracy", "eval/rm/loss", "eval/rm/accuracy"} <= metrics.keys()
    saved = check_reward_model_dir(tmp_path / "rm")
    assert saved["base_model"] == "tiny" and saved["config"]["max_len"] == 64 and saved["metrics"] == metrics
    assert RewardModel.load(tmp_path / "rm").max_len == 64
    assert read_preference_pairs(held_out)[0].chosen.endswith("yes")
