"""bench/scheduler_scale.py on two runs with a short past: the real scheduler ticks them, their
workers run on the scripted launcher, and the row counts them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from services.core.config import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("scheduler_scale", REPO / "bench" / "scheduler_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_row_counts_the_runs_pods_and_ticks(bench, settings: Settings) -> None:
    row = bench.measure(settings, "sqlite", runs=2, history=3, ticks=2, gets=3)
    assert row.pods == 2 * bench.WORKERS
    assert len(row.ticks) == 2 and len(row.gets) == 3
    assert row.store_bytes > 0
    assert str(row).split()[:4] == ["2", str(2 * bench.WORKERS), "sqlite", "3"]


def test_kafka_partitions_follow_the_layout(bench) -> None:
    assert bench.kafka_partitions(1000, max_workers=10, replication=3).startswith(
        "1000 runs x 2 topics x 10 partitions = 20000 partitions; x3 replicas = 60000 partition replicas: at least 15 brokers"
    )
