"""`spotrl demo`, the README's first command, as a user runs it: a process on a fresh home, the
tiny model, its summary and its exit code (the SmolLM2 demo takes minutes; its code path is this one).
Two iterations (``--iterations 2``) rather than the tiny demo's three: every step of the loop, and
a second training job that starts from the first one's policy, at two thirds of the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_trains_bills_and_exits_0(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    summary = tmp_path / "summary.json"
    env = {**os.environ, "SPOTRL_MODEL_CACHE": str(tmp_path_factory.getbasetemp() / "models")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "demo",
            "--model",
            "tiny",
            "--home",
            str(tmp_path / "home"),
            "--summary-json",
            str(summary),
            "--iterations",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["status"] == "SUCCEEDED"
    assert [it["iteration"] for it in result["iterations"]] == [1, 2]  # as many as asked, in order
    assert all(it["samples"] > 0 for it in result["iterations"]) and result["iterations"]
    # Not "cheaper than always-on": the tiny model's training jobs are shorter than AWS's 60 s
    # minimum per launch (services/control/cost/billing.py), so a job per batch can cost more than an
    # instance held throughout.
    assert result["cost"]["total_dollars"] > 0 and result["cost"]["always_on_dollars"] > 0
    assert "always-on" in done.stdout  # the bill is printed
