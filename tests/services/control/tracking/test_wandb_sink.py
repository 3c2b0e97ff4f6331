"""The W&B sink with the real ``wandb`` package in offline mode: the runs it writes are read back from
their transaction logs (``run-<id>.wandb``: W&B's record format, CRC-checked, parsed with W&B's own
protobuf messages), as ``wandb sync`` would upload them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from services.control.tracking.points import Point
from services.control.tracking.wandb_sink import (
    EVAL_STEP,
    WandbSession,
    WandbSink,
    history_rows,
    offline_logs,
    transaction_records,
)


def train(steps: range) -> list[Point]:
    return [Point(i, 1000.0 + i, {"actor/pg_loss": 0.5 / i, "reward/mean": 0.25 * i}) for i in steps]


def history(root: Path, run_id: str) -> list[dict]:
    """Every history row of the run's offline folders, oldest folder first."""
    return [row for log in offline_logs(root, run_id) for row in history_rows(log)]


@pytest.fixture
def session(tmp_path: Path):
    opened: list[WandbSession] = []

    def open_session(api_key: str | None = None) -> WandbSession:
        opened.append(WandbSession(tmp_path / "wandb", mode="offline", api_key=api_key, base_url=None))
        return opened[-1]

    yield open_session
    for s in opened:
        s.close()


def test_points_become_the_runs_history(session, tmp_path: Path) -> None:
    key = "k" * 8 + uuid.uuid4().hex  # a W&B key is 40 characters
    opened = session(api_key=key)
    sink = WandbSink(opened, project="spotrl-test", entity=None)
    sink.write("run-a", [*train(range(1, 3)), Point(1, 1500.0, {"eval/pass@4": 0.5, "eval/mean_score": 0.25})])
    sink.write("run-a", [*train(range(3, 5)), Point(2, 1600.0, {"eval/pass@4": 0.75, "eval/mean_score": 0.5})])
    sink.end_run("run-a", "SUCCEEDED", 2000.0)
    opened.close()  # W&B's service process has written everything once it stops
    rows = history(tmp_path / "wandb", "run-a")
    iterations = [(r["_step"], r["actor/pg_loss"], r["reward/mean"]) for r in rows if "actor/pg_loss" in r]
    assert iterations == [(i, 0.5 / i, 0.25 * i) for i in (1, 2, 3, 4)]
    # The points' times; a row that an evaluation joined has the evaluation's.
    assert [r["_timestamp"] for r in rows] == [1001.0, 1500.0, 1003.0, 1600.0]
    # Evaluations against their own x axis, the policy version, each at or after its iteration's step.
    evals = [(r[EVAL_STEP], r["eval/pass@4"], r["eval/mean_score"]) for r in rows if EVAL_STEP in r]
    assert evals == [(1, 0.5, 0.25), (2, 0.75, 0.5)]
    assert [r["_step"] for r in rows if EVAL_STEP in r] == [2, 4]  # W&B refuses steps below its latest
    (log,) = offline_logs(tmp_path / "wandb", "run-a")
    records = list(transaction_records(log))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == ("run-a", "spotrl-test", "run-a")
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0
    # The key is in no file W&B wrote (logs, run files).
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert files and not [p for p in files if key.encode() in p.read_bytes()]


def test_a_restarted_session_repeats_no_point(session, tmp_path: Path) -> None:
    """A scheduler that died after writing and before advancing its cursor writes the same points
    again from a new process: the new offline folder holds only what the earlier ones lack."""
    first = session()
    WandbSink(first, project="p", entity=None).write(
        "run-b", [*train(range(1, 4)), Point(2, 1500.0, {"eval/mean_score": 0.5})]
    )
    first.close()  # the process stops; its run is left open (marked preempting) for the next to resume
    sessions_before = offline_logs(tmp_path / "wandb", "run-b")
    again_session = session()
    again = WandbSink(again_session, project="p", entity=None)
    again.write(
        "run-b",
        [*train(range(1, 6)), Point(2, 1500.0, {"eval/mean_score": 0.5}), Point(4, 1600.0, {"eval/mean_score": 0.75})],
    )
    again.end_run("run-b", "FAILED", 2000.0)
    again_session.close()
    assert len(offline_logs(tmp_path / "wandb", "run-b")) == len(sessions_before) + 1
    rows = history(tmp_path / "wandb", "run-b")
    assert [r["_step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 5]
    assert [r[EVAL_STEP] for r in rows if EVAL_STEP in r] == [2, 4]
    last = offline_logs(tmp_path / "wandb", "run-b")[-1]
    assert [r.exit.exit_code for r in transaction_records(last) if r.WhichOneof("record_type") == "exit"] == [1]


def test_a_torn_transaction_log_ends_at_its_last_whole_record(session, tmp_path: Path) -> None:
    opened = session()
    sink = WandbSink(opened, project="p", entity=None)
    sink.write("run-c", train(range(1, 3)))
    sink.end_run("run-c", "SUCCEEDED", 2000.0)
    opened.close()
    (log,) = offline_logs(tmp_path / "wandb", "run-c")
    data = log.read_bytes()
    whole = len(list(transaction_records(log)))
    log.write_bytes(data[:-3])  # a process killed mid-write
    assert 0 < len(list(transaction_records(log))) < whole
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(transaction_records(Path(__file__)))
