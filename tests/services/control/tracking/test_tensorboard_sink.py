"""The TensorBoard sink's event files, read back with TensorBoard's own reader (its EventAccumulator
checks every record's length and data CRC, and parses the Event protobufs)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards_masked_crc32c

from services.control.tracking.points import Point
from services.control.tracking.tensorboard_sink import (
    TensorBoardSink,
    crc32c,
    event_file,
    masked_crc32c,
    tensorboard_prefix,
)
from services.ports.objects.local_object_store import LocalObjectStore


def scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar TensorBoard finds in ``logdir``: tag -> [(step, value, wall_time)]."""
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def logged_steps(logdir: Path, tag: str) -> list[int]:
    """The steps of every event of ``tag`` in every file of ``logdir``, repeats included (the
    accumulator above drops an older step's events once a file goes back to it)."""
    steps = []
    for path in sorted(logdir.iterdir()):
        for event in LegacyEventFileLoader(str(path)).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(steps)


def test_crc32c_matches_its_check_value_and_tensorboards_own() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720's check value
    rng = random.Random(7)
    for n in (0, 1, 8, 255, 4096):
        data = rng.randbytes(n)
        assert masked_crc32c(data) == tensorboards_masked_crc32c(data)


def test_points_read_back_as_tensorboard_scalars(tmp_path: Path) -> None:
    objects = LocalObjectStore(tmp_path / "objects")
    sink = TensorBoardSink(objects)
    train = [
        Point(i, 1000.0 + i, {"actor/pg_loss": 0.5 / i, "reward/mean": 0.25 * i, "cost/dollars_so_far": 0.01 * i})
        for i in (1, 2, 3)
    ]
    sink.write("r1", [*train[:2], Point(1, 1500.0, {"eval/mean_score": 0.125, "eval/pass@4": 0.5})])
    sink.write("r1", [train[2], Point(3, 1600.0, {"eval/mean_score": 0.375, "eval/pass@4": 0.75})])
    got = scalars(objects.root / tensorboard_prefix("r1"))
    assert got["actor/pg_loss"] == [(i, pytest.approx(0.5 / i), 1000.0 + i) for i in (1, 2, 3)]
    assert [v for _, v, _ in got["reward/mean"]] == [0.25, 0.5, 0.75]
    assert got["eval/pass@4"] == [(1, 0.5, 1500.0), (3, 0.75, 1600.0)]
    assert [s for s, _, _ in got["eval/mean_score"]] == [1, 3]
    assert set(got) == {"actor/pg_loss", "reward/mean", "cost/dollars_so_far", "eval/mean_score", "eval/pass@4"}
    # A file per kind and sync, named by its first step.
    assert [k.rsplit("/", 1)[1] for k in objects.list(tensorboard_prefix("r1"))] == [
        "events.out.tfevents.0000000001.spotrl-eval",
        "events.out.tfevents.0000000001.spotrl-train",
        "events.out.tfevents.0000000003.spotrl-eval",
        "events.out.tfevents.0000000003.spotrl-train",
    ]


def test_a_write_repeated_from_the_same_step_overwrites_its_file(tmp_path: Path) -> None:
    """A scheduler that died after writing and before advancing the cursor writes the same points,
    perhaps with newer ones, from the same first step: one file, no point twice."""
    objects = LocalObjectStore(tmp_path / "objects")
    points = [Point(i, 1000.0 + i, {"reward/mean": float(i)}) for i in range(1, 6)]
    TensorBoardSink(objects).write("r1", points[:3])
    first = objects.get_bytes(objects.list("runs/r1/")[0])
    TensorBoardSink(objects).write("r1", points)  # a new process: the same batch and two newer points
    assert len(objects.list("runs/r1/")) == 1
    assert objects.get_bytes(objects.list("runs/r1/")[0]).startswith(
        first
    )  # a reader that read the first sees an append
    assert scalars(objects.root / tensorboard_prefix("r1"))["reward/mean"] == [
        (i, float(i), 1000.0 + i) for i in range(1, 6)
    ]
    assert logged_steps(objects.root / tensorboard_prefix("r1"), "reward/mean") == [1, 2, 3, 4, 5]


def test_a_corrupt_record_is_refused_by_tensorboard(tmp_path: Path) -> None:
    """The checksums are what TensorBoard verifies: a flipped byte of a value is not read."""
    data = bytearray(event_file([Point(1, 1000.0, {"reward/mean": 1.0}), Point(2, 1001.0, {"reward/mean": 2.0})]))
    data[-6] ^= 0xFF  # inside the last event's data
    (tmp_path / "events.out.tfevents.0000000001.spotrl-train").write_bytes(bytes(data))
    assert scalars(tmp_path)["reward/mean"] == [(1, 1.0, 1000.0)]


def test_negative_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="a step is a count from 0"):
        event_file([Point(-1, 1000.0, {"x": 1.0})])
