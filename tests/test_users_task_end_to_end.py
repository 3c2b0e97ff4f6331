"""A user's own task, end to end through the real `spotrl serve` and real pods on the embedded
backends: a verl reward file and verl-layout Parquet sets, unchanged; the reward file served by
the run's own reward server pod; held-out evals; the figures in TensorBoard's event files.

The model is the tiny one saved with a chat template (verl's prompts are chat messages), kept
tiny so that the run takes seconds of pod time."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.core.config import Settings
from services.ports.wiring import open_backends
from tests.services.control.tracking.test_tensorboard_sink import scalars
from tests.test_end_to_end import assert_guarantees_held, serving

pytestmark = pytest.mark.slow

# A reward file as verl users write them (verl's custom_reward_function): no spotrl import.
REWARD_FILE = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = re.findall(r"\\d", solution_str)
    correct = bool(digits) and digits[-1] == str(ground_truth)[-1]
    return {"score": float(correct) + 0.1 * ("=" not in solution_str), "acc": float(correct),
            "split_index": float(extra_info["index"])}
"""


def verl_rows(n: int, split: str) -> pa.Table:
    """verl's gsm8k preprocess layout: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    return pa.Table.from_pylist(
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{a}+{a}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
                "extra_info": {"split": split, "index": a},
            }
            for a in range(n)
        ]
    )


def test_a_verl_reward_file_and_parquet_sets_train_evaluate_and_reach_tensorboard(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from trainer_core.models.loading import load_policy, save_policy

    model_cache = tmp_path_factory.getbasetemp() / "models"
    data = tmp_path / "data"
    data.mkdir()
    policy = load_policy("tiny", cache_dir=model_cache)
    policy.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    save_policy(policy, data / "tiny-chat")
    (data / "gsm8k_reward.py").write_text(REWARD_FILE)
    pq.write_table(verl_rows(12, "train"), data / "train.parquet")
    pq.write_table(verl_rows(3, "test"), data / "test.parquet")
    spec = {
        "model": str(data / "tiny-chat"),
        "prompts": str(data / "train.parquet"),
        "reward": [{"fn": "function", "path": f"{data / 'gsm8k_reward.py'}:compute_score"}],
        "reward_server": {"instance_type": "g4dn.xlarge"},
        "eval": {
            "prompts": str(data / "test.parquet"),
            "every_iterations": 1,
            "samples_per_prompt": 2,
            "max_new_tokens": 4,
            "metrics": ["mean", "pass@2"],
        },
        "tracking": {"tensorboard": True},
        "samples_per_prompt": 4,
        "sampling": {"max_new_tokens": 6},
        "batch_samples": 16,
        "iterations": 2,
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 4},
        "training": {"learning_rate": 1e-3, "micro_batch": 8},
    }

    with serving(tmp_path, model_cache, SPOTRL_DATA_DIRS=str(data)) as served:
        r = served.client.post("/v1/runs", json=spec)
        assert r.status_code == 201, r.text
        run = served.wait_for(r.json()["id"], timeout_s=300)
        assert run["status"] == "SUCCEEDED", (run["status_reason"], run["last_error"])
        run_id = run["id"]
        assert run["reward_failures"] == 0, run["reward_failures_by_reason"]
        # The reward file's dict: its score trains, its other figures are averaged into each iteration.
        for it in served.client.get(f"/v1/runs/{run_id}").json()["iterations"]:
            assert 0.0 <= it["metrics"]["reward/acc/mean"] <= 1.0 and "reward/split_index/mean" in it["metrics"]
        assert [e["policy_version"] for e in run["evals"]] == [0, 1, 2]
        assert all(set(e["metrics"]) == {"mean", "pass@2"} and e["prompts"] == 3 for e in run["evals"])
        cost = served.client.get(f"/v1/runs/{run_id}/cost").json()
        assert {"rollout", "training", "eval", "reward"} <= set(cost["by_role"])
        reward_entries = [e for e in cost["entries"] if e["role"] == "reward"]
        assert reward_entries and all(e["instance_type"] == "g4dn.xlarge" and e["ended_at"] for e in reward_entries)
        worker_log = served.client.get(f"/v1/runs/{run_id}/pods/{run_id}-rollout-0/logs").json()
        assert "scoring through the run's reward server at http://127.0.0.1:" in "\n".join(worker_log["lines"])
        server_log = "\n".join(served.client.get(f"/v1/runs/{run_id}/pods/{run_id}-reward/logs").json()["lines"])
        assert (
            server_log.count("POST /v1/score") >= 3 + 1
        )  # each eval's batch, and the workers' (some may hit the cache)

        # The scheduler's tracker sends what the state store recorded, a few seconds behind.
        logdir = tmp_path / "home" / "objects" / "runs" / run_id / "tensorboard"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _tracked_through(logdir, iteration=2, version=2):
            time.sleep(0.5)
        tb = scalars(logdir)
        assert [step for step, _, _ in tb["reward/mean"]] == [1, 2]
        assert [step for step, _, _ in tb["eval/mean_score"]] == [0, 1, 2]
        assert [step for step, _, _ in tb["reward/acc/mean"]] == [1, 2]

    backends = open_backends(Settings(home=tmp_path / "home"))
    try:
        roles = {m.role for m in backends.state.pod_memory(run_id)}
        assert {"rollout", "training", "reward"} <= roles  # every pod reported its memory
    finally:
        backends.close()
    assert_guarantees_held(tmp_path / "home", run)


def _tracked_through(logdir: Path, *, iteration: int, version: int) -> bool:
    if not logdir.is_dir():
        return False
    tb = scalars(logdir)
    return any(s == iteration for s, _, _ in tb.get("reward/mean", [])) and any(
        s == version for s, _, _ in tb.get("eval/mean_score", [])
    )
