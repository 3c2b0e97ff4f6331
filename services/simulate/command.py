"""``spotrl simulate``: one run on a spot trace under one cost policy (``services.simulate.world``).

The workload options are shared with ``bench/cost_policies.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from services.runspec import CostPolicy

BatchSamples = Annotated[int, typer.Option(help="Samples per training batch.")]
Iterations = Annotated[int, typer.Option(help="Training iterations of the run.")]
Workers = Annotated[int, typer.Option(help="Spot rollout workers the threshold rule holds for one batch.")]
MaxWorkers = Annotated[int, typer.Option(help="Most rollout workers a policy may hold.")]
WorkerRate = Annotated[float, typer.Option(help="Samples per hour of one rollout worker.")]
TrainingMinutes = Annotated[float, typer.Option(help="Minutes of training per batch on the training instance.")]
Startup = Annotated[float, typer.Option(help="Node start plus model load per launch, seconds.")]
Notice = Annotated[float, typer.Option(help="Seconds of notice before a spot preemption (AWS 120, GCP 30).")]
Staleness = Annotated[int, typer.Option(help="Policy versions a sample may lag before it is dropped.")]
DeadlineHours = Annotated[float | None, typer.Option(help="Deadline of the run, hours (cost-aware may then use on-demand rollout).")]
RolloutType = Annotated[str, typer.Option(help="Catalog instance type of the rollout workers.")]
TrainingType = Annotated[str, typer.Option(help="Catalog instance type of the training job (on-demand).")]


def workload(batch_samples: int, iterations: int, workers: int, max_workers: int, worker_samples_per_hour: float,
             training_minutes: float, startup_seconds: float, spot_notice_seconds: float, staleness_bound: int,
             deadline_hours: float | None, rollout_instance_type: str, training_instance_type: str):
    from services.simulate.world import Workload

    return Workload(
        batch_samples=batch_samples, iterations=iterations, workers=workers, max_workers=max_workers,
        worker_samples_per_hour=worker_samples_per_hour, training_minutes=training_minutes,
        startup_seconds=startup_seconds, spot_notice_seconds=spot_notice_seconds, staleness_bound=staleness_bound,
        deadline_seconds=None if deadline_hours is None else deadline_hours * 3600.0,
        rollout_instance_type=rollout_instance_type, training_instance_type=training_instance_type,
    )


def simulate_command(
    trace: Annotated[Path, typer.Option(help="SkyPilot spot-traces JSON: spot instances available per tick.", exists=True, dir_okay=False)],
    policy: Annotated[CostPolicy, typer.Option(help="Cost policy to run.")] = CostPolicy.COST_AWARE,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures to this JSON file.")] = None,
    batch_samples: BatchSamples = 5000,
    iterations: Iterations = 12,
    workers: Workers = 4,
    max_workers: MaxWorkers = 16,
    worker_samples_per_hour: WorkerRate = 3000.0,
    training_minutes: TrainingMinutes = 18.0,
    startup_seconds: Startup = 90.0,
    spot_notice_seconds: Notice = 120.0,
    staleness_bound: Staleness = 1,
    deadline_hours: DeadlineHours = None,
    rollout_instance_type: RolloutType = "g6.xlarge",
    training_instance_type: TrainingType = "p4d.24xlarge",
) -> None:
    """Simulate a run on a spot trace: the real scheduler's plan() every tick, with a simulated
    launcher, queue, clock and ledger; print (and with --json write) its bill and figures, money in
    the run's currency (``currency``: the price catalog's for the instance types, e.g. CNY on Alibaba
    Cloud). A trace's optional ``prices`` bill spot rollout tick by tick, in that currency."""
    from services.simulate.traces import load_trace
    from services.simulate.world import simulate

    try:
        work = workload(batch_samples, iterations, workers, max_workers, worker_samples_per_hour, training_minutes,
                        startup_seconds, spot_notice_seconds, staleness_bound, deadline_hours,
                        rollout_instance_type, training_instance_type)
        result = simulate(load_trace(trace), policy, work)
    except ValueError as e:  # a bad trace, an unknown instance type, an impossible run spec
        raise typer.BadParameter(str(e)) from None
    figures = result.to_json()
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")
    typer.echo(json.dumps(figures, indent=2))
    if not result.finished:
        typer.echo(f"the run had not ended after {work.horizon_days:g} simulated days (too little spot capacity in the trace?)", err=True)
