"""The three-stage pipeline a user runs from the command line: SFT -> reward model -> PPO
with that reward model as the run's reward, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from services.cli.main import app
from trainer_core.models.loading import load_policy
from trainer_core.supervised.reward_model import RewardModel


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_then_reward_model_then_ppo_scored_by_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOTRL_MODEL_CACHE", str(tmp_path / "models"))
    runner = CliRunner()
    sft_data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"say {c}", "response": c * 3} for c in "abcd"])
    prefs = _jsonl(
        tmp_path / "prefs.jsonl",
        [{"prompt": f"q{i}", "chosen": "yes" * (1 + i % 3), "rejected": "no" * (1 + i % 3)} for i in range(16)],
    )

    sft = runner.invoke(
        app,
        [
            "sft",
            "tiny",
            str(sft_data),
            str(tmp_path / "sft"),
            "--lr",
            "1e-2",
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--home",
            str(tmp_path / "home"),
        ],
    )
    assert sft.exit_code == 0, sft.output
    load_policy(tmp_path / "sft", cache_dir=tmp_path / "models")  # a policy directory a run can start from

    rm = runner.invoke(
        app,
        [
            "train-rm",
            str(tmp_path / "sft"),
            str(prefs),
            str(tmp_path / "rm"),
            "--lr",
            "1e-3",
            "--epochs",
            "3",
            "--batch-size",
            "8",
            "--home",
            str(tmp_path / "home"),
        ],
    )
    assert rm.exit_code == 0, rm.output
    assert "pairwise accuracy" in rm.output
    RewardModel.load(tmp_path / "rm")

    spec = {
        "model": str(tmp_path / "sft"),
        "algorithm": "ppo",
        "prompts": [{"prompt": f"say {c}"} for c in "ab"],
        "reward": [{"fn": "reward_model", "path": str(tmp_path / "rm")}],
        "samples_per_prompt": 4,
        "sampling": {"max_new_tokens": 6},
        "batch_samples": 8,
        "iterations": 1,
    }
    spec_file = tmp_path / "ppo.json"
    spec_file.write_text(json.dumps(spec))
    ppo = runner.invoke(
        app, ["train", "--colocated", str(spec_file), "--out", str(tmp_path / "ppo"), "--home", str(tmp_path / "home")]
    )
    assert ppo.exit_code == 0, ppo.output
    assert "iteration 1: mean reward" in ppo.output and "stopped: iterations" in ppo.output
    load_policy(tmp_path / "ppo" / "policy", cache_dir=tmp_path / "models")
