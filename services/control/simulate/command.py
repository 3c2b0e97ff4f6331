"""``spotrl simulate``: one run on a spot trace under one cost policy (``services.control.simulate.world``).

Its workload options are the ``Workload`` fields with a help text (``workload_options``), which
``bench/cost_policies.py`` takes too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from services.control.simulate.workload import Workload
from services.domain.runspec import CostPolicy


def workload_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with one typer option for each ``Workload`` field that has a help text, its
    default the field's, in place of its parameter ``workload``, which it is called with, built
    from them: so the simulator and the bench read their workload options from one declaration."""
    hints = typing.get_type_hints(Workload)
    fields = [f for f in dataclasses.fields(Workload) if "help" in f.metadata]
    options = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default,
            annotation=Annotated[hints[f.name], typer.Option(help=f.metadata["help"])],
        )
        for f in fields
    ]
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "workload"]

    @functools.wraps(command)
    def with_workload(**kwargs: Any) -> Any:
        work = Workload(**{f.name: kwargs.pop(f.name) for f in fields})
        return command(workload=work, **kwargs)

    with_workload.__signature__ = inspect.Signature([*own, *options])  # type: ignore[attr-defined]
    with_workload.__annotations__ = {p.name: p.annotation for p in [*own, *options]}
    return with_workload


@workload_options
def simulate_command(
    trace: Annotated[
        list[Path],
        typer.Option(
            help="SkyPilot spot-traces JSON: spot instances available per tick. Repeat it for more rollout options: "
            "the rollout instance type in each further trace's zone (named after the file).",
            exists=True,
            dir_okay=False,
        ),
    ],
    policy: Annotated[CostPolicy, typer.Option(help="Cost policy to run.")] = CostPolicy.COST_AWARE,
    training_trace: Annotated[
        list[Path] | None,
        typer.Option(
            help="SkyPilot spot-traces JSON of the training instance type's spot nodes, for --training-capacity "
            "spot or auto (none: no spot training node ever comes). Repeat it for several spot training zones "
            "(training.spot_zones, each named after its file).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures to this JSON file.")] = None,
    *,
    workload: Workload,
) -> None:
    """Simulate a run on a spot trace: the real scheduler's plan() every tick, with a simulated
    launcher, queue, clock and ledger; print (and with --json write) its bill and figures, money in
    the run's currency (``currency``: the price catalog's for the instance types, e.g. CNY on Alibaba
    Cloud). A trace's optional ``prices`` bill its spot pods tick by tick, in that currency."""
    from services.control.simulate.traces import load_trace
    from services.control.simulate.world import simulate

    try:
        training = [load_trace(t) for t in training_trace or []]
        result = simulate([load_trace(t) for t in trace], policy, workload, training_trace=training)
    except ValueError as e:  # a bad trace, an unknown instance type, an impossible run spec
        raise typer.BadParameter(str(e)) from None
    figures = result.to_json()
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")
    typer.echo(json.dumps(figures, indent=2))
    if not result.finished:
        typer.echo(
            f"the run had not ended after {workload.horizon_days:g} simulated days (too little spot capacity in the trace?)",
            err=True,
        )
