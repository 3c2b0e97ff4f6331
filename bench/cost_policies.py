"""Every cost policy over every spot trace: the simulator (``spotrl simulate``) driving the real
scheduler's plan() (a benchmark, not a test).

    .venv/bin/python bench/cost_policies.py [--traces DIR] [--explain] [--oracle] [workload flags of `spotrl simulate`]

Default traces: ``../shared/traces`` beside the repository (SpotHedge's GCP A100 zones and
SpotServe's AWS g4dn, with their sources in its README). Default workload, the seed's: batches
of 5000 samples, 4 spot rollout workers at 3,000 samples/h each, 18 minutes of training per
batch, 90 s of node start plus model load per launch, staleness bound 1; 12 iterations.

Prints one row per (trace, policy), money in the run's currency (the price catalog's for the
rollout and training instance types: USD on AWS and GCP, CNY on Alibaba Cloud), then checks the targets set for cost-aware on every
trace where the threshold run ends (<= 1.15x the lower bound; never dearer than threshold or
always-on; wall time within 5% of threshold's or better) and on the mean (closes at least half
of the gap threshold leaves to the bound), the saving against always-on, and a sweep over the
training minutes per batch on the sweep trace. ``--oracle`` adds each trace's offline optimum
(``services.control.simulate.oracle``: the cheapest schedule with the policies' levers, known
the trace in advance) and each policy's dollars over it (a few seconds a trace).

Then spot training (``training.capacity``): cost-aware with its training on-demand against
cost-aware with ``auto`` (spot while it pays, on-demand where no spot node comes), with
threshold and always-on under ``auto`` too and, with ``--oracle``, the offline optimum with spot
training; checked: auto at most 0.7x on-demand training's cost where the trace has training spot
capacity; never dearer than threshold or always-on, wall within 5% of threshold's, at most 1.10x
the oracle, where threshold ends. The training traces: SpotHedge's traces are a zone's spot
A100 8-GPU nodes (training-class capacity), so a trace under ``spothedge-gcp-a100/`` is also its
run's training trace, the workload's training type (by default p4d.24xlarge, 8 x A100) at its
catalog spot price. An approximation: the zone's nodes are one capacity both pools draw from,
but the simulator offers the rollout pool and the training job each all of them (a node counted
for rollout is counted again for training), which flatters spot training where the zone has a
node or two. SpotServe's g4dn trace holds no training-class capacity: no training trace (no spot
training node ever comes). ``--training-capacity auto`` (a workload option) runs the tables
above with it too.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from services.control.simulate.command import workload_options
from services.control.simulate.gap import PARTS, forced_training_startups
from services.control.simulate.oracle import OracleResult
from services.control.simulate.oracle import oracle as optimum
from services.control.simulate.traces import SpotTrace, load_trace, traces_in
from services.control.simulate.workload import Workload
from services.control.simulate.world import SimResult, simulate
from services.domain.runspec import CostPolicy
from services.ports.prices.catalog import load_catalog

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
SWEEP_MINUTES = (2, 5, 10, 18, 30, 40)
# The folder of SpotHedge's traces: spot A100 8-GPU nodes of a zone, training-class capacity.
TRAINING_CLASS_TRACES = "spothedge-gcp-a100"
# Spot training's targets: auto's cost over on-demand training's (where spot training nodes exist)
# and cost-aware's over the oracle's.
SPOT_TRAINING_RATIO = 0.7
TO_ORACLE = 1.10
TRAINING_TRACE_NOTE = (
    "training trace: a SpotHedge A100 zone's own trace (its nodes offered to rollout and training each in "
    "full, not shared: optimistic where the zone has few), none for g4dn (no training-class spot capacity)"
)


def training_trace_for(path: Path, trace: SpotTrace) -> SpotTrace | None:
    """The spot training nodes beside ``trace`` (read from ``path``): itself for a SpotHedge A100
    zone's trace (8 x A100 nodes: training-class), none for the others."""
    return trace if TRAINING_CLASS_TRACES in path.parts else None


def _row(trace: str, r: SimResult, best: OracleResult | None = None) -> str:
    ratio = r.dollars / r.lower_bound_dollars if r.lower_bound_dollars else float("nan")
    end = "" if r.finished else "  (not ended)"
    to_oracle = "" if best is None else f" {_to_oracle(r, best):>5} |"
    return (
        f"| {trace:<34} | {r.policy:<10} | {r.dollars:>8.2f} | {ratio:>5.3f} |{to_oracle} {r.lower_bound_dollars:>7.2f} | "
        f"{r.always_on_dollars:>8.2f} | {r.wall_seconds / 3600:>6.2f} | {r.samples_trained:>6} | {r.samples_dropped_stale:>5} | "
        f"{r.preemptions:>4} | {r.training_busy_fraction:>5.3f} |{end}"
    )


def _to_oracle(r: SimResult, best: OracleResult) -> str:
    """A run's dollars over the oracle's, for a run that ended ("-" otherwise)."""
    return f"{r.dollars / best.dollars:.3f}" if r.finished and best.finished else "-"


def _oracle_row(trace: str, best: OracleResult) -> str:
    """The offline optimum's row: its dollars, x bound, and what it has of the others' columns."""
    if not best.finished:
        return f"| {trace:<34} | {'oracle':<10} |        - |     - |     - |       - |        - |      - |      - |     - |    - |     - |  (no schedule ends)"
    new_nodes = f"{best.new_nodes} new training node(s), {sum(b.on_demand_seconds for b in best.batches) / 3600:.1f} on-demand rollout worker-h"
    return (
        f"| {trace:<34} | {'oracle':<10} | {best.dollars:>8.2f} | {best.dollars / best.lower_bound_dollars:>5.3f} | 1.000 | "
        f"{best.lower_bound_dollars:>7.2f} |        - | {best.wall_seconds / 3600:>6.2f} |      - |     - |    - |     - |  {new_nodes}"
    )


def _explain(results: dict[str, dict[CostPolicy, SimResult]], traces: list[SpotTrace], w: Workload) -> None:
    """One line per (trace, policy): its dollars above the bound, by part (services.control.simulate.gap);
    then, per trace, the most of threshold's gap a policy can close, the training start-ups it
    cannot avoid (``forced_training_startups``) left."""
    typer.echo("\ndollars above the bound, by part (services.control.simulate.gap):")
    typer.echo("| trace | policy | gap | " + " | ".join(PARTS) + " |\n|---|---|" + "---:|" * (len(PARTS) + 1))
    for name, by_policy in results.items():
        for r in by_policy.values():
            if r.finished:
                typer.echo(
                    f"| {name} | {r.policy} | {r.dollars - r.lower_bound_dollars:.2f} | "
                    + " | ".join(f"{r.gap[k]:.2f}" for k in PARTS)
                    + " |"
                )
    training = load_catalog().get(w.training_instance_type)
    startup_dollars, cur = w.startup_seconds * training.on_demand / 3600.0, training.currency
    typer.echo("\nthe most of threshold's gap a policy closes, the training start-ups it must pay left:")
    most: list[float] = []
    for trace in traces:
        th = results[trace.name][CostPolicy.THRESHOLD]
        if not th.finished:
            continue
        spot = min(max(trace.available), w.max_workers)
        forced = forced_training_startups(
            th.samples_trained // w.batch_samples,
            w.batch_samples,
            spot,
            w.worker_samples_per_hour / 3600.0,
            w.training_minutes * 60.0,
            w.startup_seconds,
            w.staleness_bound,
        )
        gap = th.dollars - th.lower_bound_dollars
        most.append(1 - forced * startup_dollars / gap)
        typer.echo(
            f"  {trace.name}: at most {spot} spot workers, {forced} forced start-ups ({cur} {forced * startup_dollars:.2f} "
            f"of {cur} {gap:.2f}): at most {most[-1]:.0%} closable"
        )
    typer.echo(f"  mean: at most {statistics.mean(most):.0%} closable" if most else "  no run ended")


def header(currency: str, oracle: bool = False) -> str:
    """The table's header, its money columns in ``currency`` (with ``oracle``, a column of x the oracle's)."""
    return (
        f"| trace                              | policy     | {currency:>8} | x bnd |{' x orc |' if oracle else ''}   bound | always-on |  wall h | trained | "
        f"stale | pre. | busy  |\n|---|---|---:|---:|{'---:|' if oracle else ''}---:|---:|---:|---:|---:|---:|---:|"
    )


def _spot_training(
    loaded: list[SpotTrace],
    training: dict[str, SpotTrace | None],
    results: dict[str, dict[CostPolicy, SimResult]],
    workload: Workload,
    currency: str,
    oracle: bool,
    oracle_step: float,
) -> list[str]:
    """Cost-aware with its training on-demand beside cost-aware with ``training.capacity`` auto, per
    trace (threshold and always-on under auto, and the oracle with spot training, for the targets);
    the targets missed."""
    on_demand, auto = replace(workload, training_capacity="on-demand"), replace(workload, training_capacity="auto")
    typer.echo(
        f"\nspot training: cost-aware with training on-demand against training.capacity auto ({currency}; "
        f"pre.: preemptions, rollout and training; {TRAINING_TRACE_NOTE}):"
    )
    typer.echo(
        "| trace | training trace | on-demand training | wall h | pre. | auto | wall h | pre. | auto / on-demand | "
        f"threshold auto | always-on auto |{' oracle auto | wall h | auto / oracle |' if oracle else ''}\n"
        f"|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|---:|---:|' if oracle else ''}"
    )
    failures: list[str] = []
    checked: list[str] = []
    for trace in loaded:
        name, nodes = trace.name, training[trace.name]
        runs = {
            pol: results[name][pol]
            if workload.training_capacity == "auto"
            else simulate(trace, pol, auto, training_trace=nodes)
            for pol in CostPolicy
        }
        od = (
            results[name][CostPolicy.COST_AWARE]
            if workload.training_capacity == "on-demand"
            else simulate(trace, CostPolicy.COST_AWARE, on_demand, training_trace=nodes)
        )
        ca, th, ao = runs[CostPolicy.COST_AWARE], runs[CostPolicy.THRESHOLD], runs[CostPolicy.ALWAYS_ON]
        best = optimum(trace, auto, step_seconds=oracle_step, training_trace=nodes) if oracle else None
        ratio = f"{ca.dollars / od.dollars:.3f}" if ca.finished and od.finished else "-"
        cells = [
            name,
            "none" if nodes is None else ("itself (no node)" if max(nodes.available) == 0 else "itself"),
            _dollars(od),
            f"{od.wall_seconds / 3600:.2f}",
            str(od.preemptions),
            _dollars(ca),
            f"{ca.wall_seconds / 3600:.2f}",
            str(ca.preemptions),
            ratio,
            _dollars(th),
            _dollars(ao),
        ]
        if best is not None:
            cells += [
                f"{best.dollars:.2f}" if best.finished else "-",
                f"{best.wall_seconds / 3600:.2f}" if best.finished else "-",
                _to_oracle(ca, best),
            ]
        typer.echo("| " + " | ".join(cells) + " |")
        checks: dict[str, bool] = {}
        if nodes is not None and max(nodes.available) > 0:
            checks[f"auto <= {SPOT_TRAINING_RATIO}x on-demand training"] = (
                ca.finished and ca.dollars <= SPOT_TRAINING_RATIO * od.dollars
            )
        if th.finished:  # (a run that did not end is dearer than any that did)
            checks["<= threshold"] = ca.finished and ca.dollars <= th.dollars + 1e-9
            checks["<= always-on"] = ca.finished and ca.dollars <= ao.dollars + 1e-9
            checks["wall <= 1.05x threshold"] = ca.finished and ca.wall_seconds <= 1.05 * th.wall_seconds
            if best is not None:
                checks[f"<= {TO_ORACLE}x oracle"] = ca.finished and ca.dollars <= TO_ORACLE * best.dollars
        if not checks:
            checked.append(f"  {name}: no check (threshold never ends and no training spot capacity)")
            continue
        failures += [f"{name} (spot training): {k}" for k, ok in checks.items() if not ok]
        checked.append(f"  {name}: " + ", ".join(f"{k} {'ok' if ok else 'MISSED'}" for k, ok in checks.items()))
    typer.echo(
        "\ncost-aware with training.capacity auto against the others under auto "
        f"(auto <= {SPOT_TRAINING_RATIO}x where the trace has training spot capacity; the rest where threshold ends):"
    )
    typer.echo("\n".join(checked))
    if oracle:
        typer.echo("  (the oracle values no wall time: where waiting for spot costs nothing it waits, days if need be)")
    return failures


def _several_zones(
    paths: list[Path],
    loaded: list[SpotTrace],
    results: dict[str, dict[CostPolicy, SimResult]],
    workload: Workload,
    currency: str,
) -> None:
    """Cost-aware on one SpotHedge zone against the same run whose rollout pool may also use the
    other zones (``rollout.options``: the rollout instance type in each, one trace per option),
    training on-demand, with ``training.capacity`` auto on the first zone's nodes, and with auto
    on every zone's (``training.spot_zones``: each zone's trace as its training nodes)."""
    zones = [t for path, t in zip(paths, loaded, strict=True) if TRAINING_CLASS_TRACES in path.parts]
    if len(zones) < 2:
        return
    auto = replace(workload, training_capacity="auto")
    typer.echo(
        f"\nseveral zones: cost-aware on one zone against its rollout pool spread over all {len(zones)} SpotHedge zones "
        f"(rollout.options; under auto, training on the first zone's own nodes, or on every zone's: "
        f"training.spot_zones) ({currency}, wall h):"
    )
    typer.echo(
        "| first zone | one zone | wall h | all zones | wall h | one zone, auto | wall h | all zones, auto | wall h "
        "| all zones, auto in all zones | wall h |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for zone in zones:
        spread = [zone, *(t for t in zones if t is not zone)]
        one = results[zone.name][CostPolicy.COST_AWARE]
        many = simulate(spread, CostPolicy.COST_AWARE, workload)
        one_auto = simulate(zone, CostPolicy.COST_AWARE, auto, training_trace=zone)
        many_auto = simulate(spread, CostPolicy.COST_AWARE, auto, training_trace=zone)
        zoned = simulate(spread, CostPolicy.COST_AWARE, auto, training_trace=spread)
        cells = [f"{_dollars(r)} | {r.wall_seconds / 3600:.2f}" for r in (one, many, one_auto, many_auto, zoned)]
        typer.echo(f"| {zone.name} | " + " | ".join(cells) + " |")


def _dollars(r: SimResult) -> str:
    return f"{r.dollars:.2f}" + ("" if r.finished else " (not ended)")


@workload_options
def main(
    traces: Annotated[
        Path, typer.Option(help="Directory of SkyPilot spot-traces JSON files (searched recursively).")
    ] = SHARED_TRACES,
    sweep_trace: Annotated[
        str, typer.Option(help="Trace (file stem) of the training-minutes sweep.")
    ] = "g4dn_nodes_60s",
    explain: Annotated[bool, typer.Option(help="Also print where each run's dollars above the bound go.")] = False,
    oracle: Annotated[
        bool,
        typer.Option(
            help="Also compute each trace's offline optimum (services/control/simulate/oracle.py) and each policy's ratio to it."
        ),
    ] = False,
    oracle_step: Annotated[float, typer.Option(help="The oracle's time step, seconds (its launches' grid).")] = 30.0,
    *,
    workload: Workload,
) -> None:
    paths = traces_in(traces)
    loaded = [load_trace(path) for path in paths]
    training = {t.name: training_trace_for(path, t) for path, t in zip(paths, loaded, strict=True)}
    results = {
        t.name: {pol: simulate(t, pol, workload, training_trace=training[t.name]) for pol in CostPolicy} for t in loaded
    }
    currency = load_catalog().currency_of(
        [workload.rollout_instance_type, workload.training_instance_type]
    )  # every run's
    best = (
        {t.name: optimum(t, workload, step_seconds=oracle_step, training_trace=training[t.name]) for t in loaded}
        if oracle
        else {}
    )
    if workload.training_capacity != "on-demand":
        typer.echo(f"training.capacity {workload.training_capacity}; {TRAINING_TRACE_NOTE}")
    typer.echo(header(currency, oracle))
    for name, by_policy in results.items():
        for r in by_policy.values():
            typer.echo(_row(name, r, best.get(name)))
        if oracle:
            typer.echo(_oracle_row(name, best[name]))
    if oracle:
        typer.echo("\neach policy's dollars over the oracle's (its offline optimum; target for cost-aware <= 1.10x):")
        for name, by_policy in results.items():
            cells = ", ".join(f"{r.policy} {_to_oracle(r, best[name])}" for r in by_policy.values())
            typer.echo(f"  {name}: {cells}")

    if explain:
        _explain(results, loaded, workload)

    failures: list[str] = []
    closed: list[float] = []
    typer.echo("\ncost-aware against the others (runs that ended under threshold):")
    for name, by in results.items():
        ca, th, ao = by[CostPolicy.COST_AWARE], by[CostPolicy.THRESHOLD], by[CostPolicy.ALWAYS_ON]
        if not th.finished:
            typer.echo(f"  {name}: threshold never ends (no spot capacity to make samples); skipped")
            continue
        bound = ca.lower_bound_dollars
        gap = th.dollars - bound
        closed.append((th.dollars - ca.dollars) / gap if gap > 0 else 1.0)
        checks = {
            "<= 1.15x bound": ca.dollars <= 1.15 * bound,
            "<= threshold": ca.dollars <= th.dollars + 1e-9,
            "<= always-on": ca.dollars <= ao.dollars + 1e-9,
            "wall <= 1.05x threshold": ca.wall_seconds <= 1.05 * th.wall_seconds,
        }
        failures += [f"{name}: {k}" for k, ok in checks.items() if not ok]
        typer.echo(
            f"  {name}: {ca.dollars / bound:.3f}x bound (threshold {th.dollars / bound:.3f}x), "
            f"wall {ca.wall_seconds / th.wall_seconds:.3f}x threshold's, gap closed {closed[-1]:+.0%}, "
            f"saves {1 - ca.dollars / ao.dollars:.0%} against the always-on policy and "
            f"{1 - ca.dollars / ca.always_on_dollars:.0%} against its always-on cluster; "
            + ", ".join(f"{k} {'ok' if ok else 'MISSED'}" for k, ok in checks.items())
        )
    mean_closed = statistics.mean(closed) if closed else 0.0
    if mean_closed < 0.5:
        failures.append(f"mean gap closed {mean_closed:.0%} < 50%")
    typer.echo(f"  mean gap closed: {mean_closed:.0%} (target >= 50%)")

    failures += _spot_training(loaded, training, results, workload, currency, oracle, oracle_step)
    _several_zones(paths, loaded, results, workload, currency)

    sweep = next((t for t in loaded if t.name == sweep_trace), loaded[0])
    typer.echo(f"\nsweep over training minutes per batch, trace {sweep.name} ({currency}, x bound, wall h):")
    typer.echo("| min/batch | " + " | ".join(p.value for p in CostPolicy) + " |\n|---:|" + "---|" * len(CostPolicy))
    for minutes in SWEEP_MINUTES:
        cells = []
        for pol in CostPolicy:
            r = simulate(sweep, pol, replace(workload, training_minutes=minutes), training_trace=training[sweep.name])
            cells.append(f"{r.dollars:.2f} ({r.dollars / r.lower_bound_dollars:.3f}x, {r.wall_seconds / 3600:.1f} h)")
        typer.echo(f"| {minutes} | " + " | ".join(cells) + " |")

    typer.echo("\ntargets: " + ("all met" if not failures else "MISSED: " + "; ".join(failures)))


if __name__ == "__main__":
    typer.run(main)
