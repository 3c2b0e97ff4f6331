"""A quantized reward model through the run's reward term and `spotrl reward-server --quantize`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from services.data.reward.functions import RewardInput, load_reward_model, terms_fingerprint, total_rewards
from services.data.reward.service import create_reward_app, model_fingerprint
from services.domain.reward_spec import RewardTerm
from tests.services.data.reward.reward_servers import reward_server, train_reward_model
from trainer_core.supervised.reward_model import RewardModel

PROMPTS, RESPONSES = ["cat?", "cat?", "sun?"], ["dog yes", "dog no", "red yes"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_reward_model(tmp_path_factory.mktemp("rm"), tmp_path_factory.getbasetemp() / "models")


def test_quantize_is_for_a_reward_model_term_with_a_path() -> None:
    assert RewardTerm(fn="reward_model", path="/rm", quantize="8bit").quantize == "8bit"
    assert RewardTerm(fn="reward_model", path="/rm").quantize is None
    with pytest.raises(ValidationError, match="`quantize` is for the reward_model reward with `path`"):
        RewardTerm(fn="regex", pattern="yes", quantize="8bit")
    with pytest.raises(ValidationError, match="`quantize` is for the reward_model reward with `path`.*--quantize"):
        RewardTerm(fn="reward_model", url="http://127.0.0.1:8100", quantize="8bit")
    with pytest.raises(ValidationError, match="quantize"):
        RewardTerm(fn="reward_model", path="/rm", quantize="2bit")
    with pytest.raises(ValidationError, match="4bit` needs a CUDA GPU.*use 8bit"):
        RewardTerm(fn="reward_model", path="/rm", quantize="4bit")


def test_the_term_scores_with_the_int8_model_loaded_once(rm_dir: Path) -> None:
    term = RewardTerm(fn="reward_model", path=str(rm_dir), quantize="8bit")
    inputs = [RewardInput(p, r, 2, None) for p, r in zip(PROMPTS, RESPONSES, strict=True)]

    got = total_rewards([term], inputs)

    assert got == pytest.approx(RewardModel.load(rm_dir, quantize="8bit").score(PROMPTS, RESPONSES), abs=1e-6)
    assert got != RewardModel.load(rm_dir).score(PROMPTS, RESPONSES)  # not the fp32 model
    assert got[0] > got[1]
    # One model per (path, quantize) in the process: the fp32 one is another.
    assert load_reward_model(str(rm_dir), "8bit") is load_reward_model(str(rm_dir), "8bit")
    assert load_reward_model(str(rm_dir), None) is not load_reward_model(str(rm_dir), "8bit")


def test_cached_rewards_of_the_int8_model_are_kept_apart(rm_dir: Path) -> None:
    full = json.loads(terms_fingerprint([RewardTerm(fn="reward_model", path=str(rm_dir))]))
    int8 = json.loads(terms_fingerprint([RewardTerm(fn="reward_model", path=str(rm_dir), quantize="8bit")]))
    assert "quantize" not in full[0]  # fingerprints of fp32 terms are the ones they were
    assert int8[0]["quantize"] == "8bit" and int8 != full

    with TestClient(create_reward_app(rm_dir, quantize="8bit")) as client:
        health = client.get("/healthz").json()
        scores = client.post(
            "/v1/score", json={"items": [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES, strict=True)]}
        ).json()
    assert health["fingerprint"] == model_fingerprint(rm_dir) + ";quantize=8bit"
    assert scores["scores"] == pytest.approx(
        RewardModel.load(rm_dir, quantize="8bit").score(PROMPTS, RESPONSES), abs=1e-6
    )


def test_spotrl_reward_server_serves_the_int8_model(rm_dir: Path) -> None:
    with reward_server("--model", str(rm_dir), "--quantize", "8bit") as (_, url, health):
        scored = httpx.post(
            f"{url}/v1/score",
            json={"items": [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES, strict=True)]},
        )
    assert health["fingerprint"].endswith(";quantize=8bit")
    assert scored.json()["scores"] == pytest.approx(
        RewardModel.load(rm_dir, quantize="8bit").score(PROMPTS, RESPONSES), abs=1e-6
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--function", "rewards.py:f", "--quantize", "8bit"], "--quantize is for a reward model (--model)"),
        (["--model", "/rm", "--quantize", "3bit"], "'3bit' is not one of '4bit', '8bit'"),
        (
            ["--model", "/rm", "--quantize", "4bit"],
            "4bit needs a CUDA GPU, and the reward server loads the model on the CPU: use 8bit",
        ),
    ],
)
def test_spotrl_reward_server_refuses_a_quantize_it_cannot_use(args: list[str], message: str) -> None:
    env = {**os.environ, "COLUMNS": "500"}  # the error on one line
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "reward-server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert message in done.stderr
