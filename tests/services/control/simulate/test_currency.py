"""The simulator's money is in the run's currency: `spotrl simulate` and the benchmark say which."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from services.cli.main import app

REPO = Path(__file__).resolve().parents[4]
ONE_INSTANCE = {"metadata": {"gap_seconds": 60}, "data": [1] * 10}
CNY_TYPES = ["--rollout-instance-type", "ecs.gn8is-4x.16xlarge", "--training-instance-type", "ecs.gn7e-c16g1.32xlarge"]
SMALL_RUN = [
    "--batch-samples",
    "40",
    "--iterations",
    "1",
    "--workers",
    "1",
    "--max-workers",
    "1",
    "--training-minutes",
    "2",
]


def test_spotrl_simulate_reports_the_runs_currency(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(ONE_INSTANCE))
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SMALL_RUN, *CNY_TYPES])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["currency"] == "CNY" and figures["dollars"] > 0


def test_spotrl_simulate_refuses_instance_types_of_two_currencies(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(ONE_INSTANCE))
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            *SMALL_RUN,
            "--rollout-instance-type",
            "g6.xlarge",
            "--training-instance-type",
            "ecs.gn7e-c16g1.32xlarge",
        ],
    )
    assert result.exit_code != 0 and "different currencies" in result.output


def test_the_benchmark_prints_the_runs_currency(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("cost_policies", REPO / "bench" / "cost_policies.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "one.json").write_text(json.dumps(ONE_INSTANCE))
    cli = typer.Typer()
    cli.command()(bench.main)
    result = CliRunner().invoke(cli, ["--traces", str(tmp_path), "--explain", *SMALL_RUN, *CNY_TYPES])
    assert result.exit_code == 0, result.output
    assert "|      CNY |" in result.output.splitlines()[0]
    assert "(CNY, x bound, wall h)" in result.output and "$" not in result.output
