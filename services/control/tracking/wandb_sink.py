"""Weights & Biases: a run's points as the history of a W&B run, through the ``wandb`` package.

What it costs: importing ``wandb`` takes 0.35 s and 27 MB (measured beside the scheduler; seconds
on a cold, busy machine), and the first ``wandb.init`` of a process 0.5 s, 13 MB more, and W&B's
service process (``wandb-core``, 33 MB), which holds the runs' streams and uploads them. So
``services.control.tracking.sinks.SinkSet`` imports this module only when a run asks for W&B: a control
plane whose runs do not use it never loads it.

Each spotrl run is the W&B run of the same id in the spec's project (and entity), resumed if it
exists. Iterations are logged at their step; W&B refuses steps below its latest one, so an
evaluation, which may arrive after newer iterations, is logged at the latest step with its own
x axis, ``eval/step`` (the policy version), that the ``eval/*`` charts are drawn against.

A write repeated after a crash logs nothing twice: before its first write for a run, a sink
learns where the run stands and skips what is not beyond it. Online (``SPOTRL_WANDB_MODE=online``,
the API key from the operator's settings) from the resumed run's step counter and summary; offline
(for clusters without a way out, then ``wandb sync`` of the folder), where each start of a process
writes a new ``offline-run-*-<id>`` folder, from the run's earlier folders (``logged_steps``).
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import wandb
from wandb.proto import wandb_internal_pb2

from services.control.tracking.points import Point
from services.control.tracking.sink import TrackingError

EVAL_STEP = "eval/step"
# The transaction log (``run-<id>.wandb``): a 7-byte header (":W&B", magic 0xBEE1, version 0),
# then LevelDB's log format: 32 KiB blocks of chunks, each a CRC-32 (of the chunk's type byte and
# data), a length and a type (full, first, middle, last); chunks are protobuf ``Record``s.
_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def transaction_records(path: Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record``s of a run's transaction log, in order; a torn last chunk
    (a process killed mid-write) ends it."""
    data = path.read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, pending = len(_HEADER), b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        if kind == 0 or len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += 7 + length
        if kind in (_FULL, _FIRST):
            pending = b""
        pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The history rows of a transaction log: key -> value (``_step``, ``_timestamp`` included)."""
    import json

    for record in transaction_records(path):
        if record.WhichOneof("record_type") == "history":
            yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def offline_logs(root: Path, run_id: str) -> list[Path]:
    """The transaction logs of ``run_id``'s offline folders under ``root`` (the ``dir`` given to W&B), oldest first."""
    return sorted((root / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def logged_steps(logs: Sequence[Path]) -> tuple[int, int]:
    """The last iteration step and the last evaluated policy version that ``logs`` hold (-1: none)."""
    train, evals = -1, -1
    for log in logs:
        for row in history_rows(log):
            if EVAL_STEP in row:
                evals = max(evals, int(row[EVAL_STEP]))
            if any(not k.startswith(("_", "eval/")) for k in row):
                train = max(train, int(row["_step"]))
    return train, evals


class _Open:
    """A W&B run open in this process, and the last iteration step and evaluated version it holds."""

    def __init__(self, run: Any, train: int, evals: int) -> None:
        self.run, self.train, self.evals = run, train, evals


class WandbSession:
    """This process's W&B: its settings (mode, key, server) and the runs it holds open."""

    def __init__(self, root: Path, *, mode: str, api_key: str | None, base_url: str | None) -> None:
        self.root, self.mode = root, mode
        # Not the run's: the scheduler's own machine statistics, code, packages and console.
        settings: dict[str, Any] = dict(
            silent=True,
            console="off",
            x_disable_stats=True,
            x_disable_meta=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
        )
        if api_key:
            settings["api_key"] = api_key
        if base_url:
            settings["base_url"] = base_url
        self._settings = wandb.Settings(**settings)
        self.runs: dict[str, _Open] = {}

    def open(self, run_id: str, project: str, entity: str | None) -> _Open:
        """The W&B run of ``run_id``, resumed or created on first use in this process."""
        if run_id in self.runs:
            return self.runs[run_id]
        earlier = offline_logs(self.root, run_id) if self.mode == "offline" else []
        if self.mode == "offline":
            # W&B names an offline run's folder by the second it starts: a second start of the run
            # within that second would write over the first's log.
            while (self.root / "wandb" / f"offline-run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}").exists():
                time.sleep(0.1)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=project,
                entity=entity,
                id=run_id,
                name=run_id,
                resume="allow",
                mode=self.mode,
                dir=self.root,
                reinit="create_new",
                settings=self._settings,
            )
        except wandb.Error as e:  # W&B's messages name the project and the server, never the key
            raise TrackingError(f"W&B: opening run {run_id} in project {project!r} failed: {e}") from None
        run.define_metric(EVAL_STEP)
        run.define_metric("eval/*", step_metric=EVAL_STEP)
        if self.mode == "offline":
            train, evals = logged_steps(earlier)
        else:  # a resumed run's step counter is past its last step; its summary holds the last eval/step
            train = run.step - 1 if run.resumed else -1
            evals = int(run.summary.get(EVAL_STEP, -1)) if run.resumed else -1
        self.runs[run_id] = _Open(run, train, evals)
        return self.runs[run_id]

    def close(self) -> None:
        """Let go of the open runs, marked preempted (another scheduler resumes them), and of W&B's service process."""
        for opened in self.runs.values():
            opened.run.mark_preempting()
            opened.run.finish()
        self.runs.clear()
        wandb.teardown()


class WandbSink:
    """The points of runs logged to one W&B ``project`` (of ``entity``; None: the API key's default)."""

    name = "wandb"

    def __init__(self, session: WandbSession, project: str, entity: str | None) -> None:
        self._session = session
        self.project, self.entity = project, entity

    def write(self, run_id: str, points: Sequence[Point]) -> None:
        opened = self._session.open(run_id, self.project, self.entity)
        try:
            for p in points:
                if p.is_eval():
                    if p.step > opened.evals:
                        at = max(opened.train, p.step)  # never below W&B's latest step
                        opened.run.log({**p.values, EVAL_STEP: p.step, "_timestamp": p.wall_time}, step=at)
                        opened.evals = p.step
                elif p.step > opened.train:
                    opened.run.log({**p.values, "_timestamp": p.wall_time}, step=p.step)
                    opened.train = p.step
        except wandb.Error as e:
            raise TrackingError(f"W&B: logging run {run_id} failed: {e}") from None

    def end_run(self, run_id: str, status: str, ended_at: float) -> None:
        opened = self._session.open(run_id, self.project, self.entity)
        try:
            opened.run.summary["spotrl/status"] = status
            opened.run.finish(exit_code=0 if status == "SUCCEEDED" else 1)
        except wandb.Error as e:
            raise TrackingError(f"W&B: ending run {run_id} failed: {e}") from None
        del self._session.runs[run_id]

    def close(self) -> None:
        """The session is the sink set's to close."""
