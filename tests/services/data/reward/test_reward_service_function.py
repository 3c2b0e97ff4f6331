"""The reward service serving a user's reward function, over real HTTP on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.data.reward.function_pool import FunctionPool
from services.data.reward.service import MAX_ITEMS, MAX_JSON_CHARS, create_reward_app, remote_fingerprint, score_remote
from services.data.reward.user_function import resolve
from tests.servers.process import free_port
from tests.services.data.reward.reward_servers import reward_server, serve
from tests.services.data.reward.user_rewards import GSM8K, HOSTILE, write

SPOTRL = [sys.executable, "-m", "services.cli.main"]


@pytest.fixture(scope="module")
def hostile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("rewards"), "hostile.py", HOSTILE)


@pytest.fixture(scope="module")
def service(hostile_path: Path) -> Iterator[str]:
    pool = FunctionPool(resolve(f"{hostile_path}:compute_score"), workers=2, timeout_s=1.0, memory_mb=512)
    yield from serve(create_reward_app(pool=pool))


def test_a_batch_is_scored_with_failures_counted_by_reason(service: str, hostile_path: Path) -> None:
    sources = ["gsm8k", "raise", "hang", "exit", "memory", "nan", "string", "gsm8k", "gsm8k"]
    responses = ["42", "42", "42", "42", "42", "42", "42", "41", "[1, 2]"]
    truths: list[object] = ["42"] * 8 + [[1, 2]]

    scores = score_remote(
        service,
        ["q"] * len(responses),
        responses,
        data_sources=sources,
        ground_truths=truths,
        extra_infos=[{"index": k} for k in range(len(responses))],
    )

    assert list(scores) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert scores.failures == [None, "exception", "timeout", "crash", "memory", "invalid", "invalid", None, None]
    assert scores.failure_counts() == Counter({"invalid": 2, "exception": 1, "timeout": 1, "crash": 1, "memory": 1})
    assert scores.metrics[0] is not None and set(scores.metrics[0]) == {"pid"}
    assert scores.metrics[1] is None
    # The service answers on, every worker included.
    again = score_remote(service, ["q"] * 8, ["7"] * 8, ground_truths=["7"] * 8)
    assert list(again) == [1.0] * 8 and again.failure_counts() == Counter()
    assert remote_fingerprint(service) == resolve(str(hostile_path)).fingerprint


def test_an_item_as_the_reward_model_takes_it_is_scored_too(service: str) -> None:
    response = httpx.post(f"{service}/v1/score", json={"items": [{"prompt": "q", "response": "None"}]}).json()
    assert (response["scores"], response["failures"], list(response["metrics"][0])) == ([1.0], [None], ["pid"])


def test_no_answer_repeats_user_code_or_what_was_sent(service: str) -> None:
    secret = "SECRET-USER-TEXT"
    raised = httpx.post(f"{service}/v1/score", json={"items": [{"response": secret, "data_source": "raise"}]})
    assert raised.status_code == 200 and secret not in raised.text
    refused = {
        "long response": [{"response": secret * 10_000}],
        "large extra_info": [{"response": "x", "extra_info": {"k": secret * (MAX_JSON_CHARS // len(secret))}}],
        "large ground_truth": [{"response": "x", "ground_truth": [secret] * (MAX_JSON_CHARS // len(secret))}],
        "long data_source": [{"response": "x", "data_source": secret * 100}],
        "extra_info not an object": [{"response": "x", "extra_info": [secret]}],
        "unknown field": [{"response": "x", "solution": secret}],
        "a field named by the client": [{"response": "x", secret: 1}],
        "too many items": [{"response": secret}] * (MAX_ITEMS + 1),
    }
    for what, items in refused.items():
        response = httpx.post(f"{service}/v1/score", json={"items": items})
        assert response.status_code == 422, what
        assert secret not in response.text, what


def test_the_app_serves_a_model_or_a_function(hostile_path: Path) -> None:
    pool = FunctionPool(resolve(str(hostile_path)))
    with pytest.raises(ValueError, match="give one of the two"):
        create_reward_app(Path("/rm"), pool=pool)
    with pytest.raises(ValueError, match="give one of the two"):
        create_reward_app()


def test_spotrl_reward_server_serves_a_verl_reward_file(tmp_path: Path) -> None:
    path = write(tmp_path, "gsm8k.py", GSM8K)
    with reward_server("--function", f"{path}:compute_score", "--workers", "2", "--timeout-s", "2") as (
        proc,
        url,
        health,
    ):
        assert health == {"status": "ok", "fingerprint": resolve(f"{path}:compute_score").fingerprint}
        scores = score_remote(url, ["q"] * 3, ["#### 42", "#### 41", "42"], ground_truths=["42"] * 3)
        assert list(scores) == [1.0, 0.0, 0.0] and scores.failures == [None] * 3
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("source", "reference", "message"),
    [
        ("raise RuntimeError('SECRET-USER-TEXT')\n", "{path}", "does not import (RuntimeError)"),
        ("SECRET = 1\n", "{path}:score", "the module defines no `score`"),
        (
            "def compute_score(solution, SECRET):\n    return 1.0\n",
            "{path}",
            "it should take (data_source, solution_str",
        ),
    ],
    ids=["does not import", "missing function", "wrong signature"],
)
def test_spotrl_reward_server_says_why_it_cannot_serve_a_function(
    tmp_path: Path, source: str, reference: str, message: str
) -> None:
    path = write(tmp_path, "broken.py", source)
    command = [*SPOTRL, "reward-server", "--function", reference.format(path=path), "--port", str(free_port())]
    env = {**os.environ, "COLUMNS": "500"}  # the error on one line
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert message in done.stderr
    assert "SECRET-USER-TEXT" not in done.stderr + done.stdout


def test_spotrl_reward_server_takes_a_model_or_a_function() -> None:
    done = subprocess.run(
        [*SPOTRL, "reward-server"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "500"}
    )
    assert done.returncode == 2 and "give exactly one of --model and --function" in done.stderr
