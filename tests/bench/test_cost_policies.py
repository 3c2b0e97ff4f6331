"""bench/cost_policies.py's spot-training section: a SpotHedge A100 trace is its own training trace,
and the section sets cost-aware with training.capacity auto beside on-demand training and the oracle."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
STEADY = {"metadata": {"gap_seconds": 60}, "data": [2] * 10}
# Two short jobs of 2 minutes on batches of 40 samples.
SMALL_RUN = ["--batch-samples", "40", "--iterations", "2", "--workers", "1", "--max-workers", "1"]
SMALL_RUN += ["--training-minutes", "2"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cost_policies", REPO / "bench" / "cost_policies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(output: str) -> dict[str, list[str]]:
    """The spot-training table's rows by trace: its cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("spot training:"))
    rows = {}
    for line in lines[start + 3 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_the_spot_training_section_trains_on_the_a100_trace_and_not_elsewhere(bench, tmp_path: Path) -> None:
    (tmp_path / bench.TRAINING_CLASS_TRACES).mkdir()
    (tmp_path / bench.TRAINING_CLASS_TRACES / "zone.json").write_text(json.dumps(STEADY))
    (tmp_path / "other.json").write_text(json.dumps(STEADY))
    cli = typer.Typer()
    cli.command()(bench.main)
    result = CliRunner().invoke(cli, ["--traces", str(tmp_path), "--oracle", *SMALL_RUN])
    assert result.exit_code == 0, result.output
    assert "a SpotHedge A100 zone's own trace" in result.output
    rows = _section(result.output)
    zone, other = rows["zone"], rows["other"]
    assert (zone[1], other[1]) == ("itself", "none")
    # On the zone's steady nodes the jobs train on spot (less than half the price); elsewhere auto
    # gives spot up and trains on-demand.
    assert float(zone[8]) < 0.7
    assert float(other[8]) >= 1.0
    # The oracle with spot training is never dearer than the run (its dollars, then its ratio).
    assert float(zone[11]) <= float(zone[5]) and float(zone[13]) >= 1.0
    assert "zone (spot training): auto <= 0.7x on-demand training" not in result.output  # met
