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


def test_a_worker_of_some_of_a_nodes_gpus_costs_its_share_of_the_node(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(ONE_INSTANCE))
    figures = {}
    for gpus in (1, 2, 4):  # a worker of 4 x L20: one per node, two or four of them per node
        result = CliRunner().invoke(
            app, ["simulate", "--trace", str(trace), *SMALL_RUN, *CNY_TYPES, "--gpus-per-worker", str(gpus)]
        )
        assert result.exit_code == 0, result.output
        figures[gpus] = json.loads(result.stdout)
    # The same work (same rate per worker), each worker paying gpus / 4 of a node.
    assert len({f["samples_trained"] for f in figures.values()}) == 1
    assert figures[1]["dollars"] < figures[2]["dollars"] < figures[4]["dollars"]
    assert figures[1]["lower_bound_dollars"] < figures[2]["lower_bound_dollars"] < figures[4]["lower_bound_dollars"]
    refused = CliRunner().invoke(
        app, ["simulate", "--trace", str(trace), *SMALL_RUN, *CNY_TYPES, "--gpus-per-worker", "3"]
    )
    assert refused.exit_code != 0 and "does not divide the 4 GPUs" in refused.output
