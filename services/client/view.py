"""What people read: a run's live progress, its bill, a list of runs (Rich renderables over the
API's JSON). ``spotrl demo`` and ``spotrl runs watch`` show a run with the same ``watch_run``."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from contracts.status import RunStatus


def run_progress(run: dict[str, Any]) -> Group:
    """One line of where the run stands with a line on what its status means, and its training
    iterations so far."""
    head = Table.grid(padding=(0, 2))
    s = run["samples"]
    status = RunStatus(run["status"])
    head.add_row(
        # While stopping, say why: the run waits for its pods to go.
        f"[bold]{run['id']}[/] {status}" + (f" ({run['status_reason']})" if status.is_stopping() else ""),
        f"policy v{run['policy_version']}",
        f"samples produced {s['produced']} · trained {s['trained']} · dropped {s['dropped']}",
        f"spent ${run['spent_dollars']:.4f}",
    )
    standing = Group(head, Text(status.meaning, style="dim"), *_latest_eval(run))
    iters = Table("iteration", "mean reward", "KL", "loss", "samples", "seconds", title="training iterations")
    for it in run["iterations"]:
        iters.add_row(
            str(it["iteration"]),
            f"{it['mean_reward']:.3f}",
            f"{it['kl']:.4f}",
            f"{it['loss']:.4f}",
            str(it["samples_trained"]),
            f"{it['seconds']:.1f}",
        )
    # The API shows a run's latest iterations only; `iterations_total` counts them all.
    total = run.get("iterations_total", len(run["iterations"]))
    if total > len(run["iterations"]):
        iters.caption = f"the latest {len(run['iterations'])} of {total} iterations"
    return Group(standing, iters)


def _latest_eval(run: dict[str, Any]) -> list[Text]:
    """A line with the latest held-out eval's figures, for a run that has one."""
    evals = run.get("evals") or []
    if not evals:
        return []
    last = evals[-1]
    figures = " · ".join(f"{name} {value:.3f}" for name, value in last["metrics"].items())
    return [Text(f"held-out eval of policy v{last['policy_version']}: {figures}")]


def cost_table(cost: dict[str, Any]) -> Group:
    """The run's bill against an always-on on-demand cluster and the lower bound, and a line
    under it on what the lower bound counts."""
    t = Table("", cost["currency"], title="cost report")
    for role, dollars in sorted(cost["by_role"].items()):
        t.add_row(f"spent: {role}", f"{dollars:.4f}")
    for cap, dollars in sorted(cost["by_capacity_type"].items()):
        t.add_row(f"spent: {cap}", f"{dollars:.4f}")
    t.add_row("[bold]spent in total[/]", f"[bold]{cost['total_dollars']:.4f}[/]")
    t.add_row("always-on on-demand, same wall time", f"{cost['always_on_dollars']:.4f}")
    t.add_row("lower bound", f"{cost['lower_bound_dollars']:.4f}")
    if cost["savings_ratio"]:
        t.add_row("savings vs always-on", f"{cost['savings_ratio']:.2f}x cheaper")
    training_seconds = sum(e["seconds"] for e in cost["entries"] if e["role"] == "training")
    if cost["wall_seconds"]:
        # The saving is the training instance's idle time: small when training dominates the
        # run (as on CPUs), large when rollout does (as with real models on GPUs).
        t.caption = f"training instance busy {training_seconds / cost['wall_seconds']:.0%} of the run's wall time"
    return Group(t, Text(cost["lower_bound_definition"]))  # the API's one line on what the bound counts


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def runs_table(runs: list[dict[str, Any]]) -> Table:
    t = Table("id", "name", "tenant", "status", "iterations", "last reward", "spent $", "created")
    for r in runs:
        reward = r["last_mean_reward"]
        t.add_row(
            r["id"],
            r["name"] or "",
            r["tenant"],
            r["status"],
            str(r["iterations_done"]),
            "-" if reward is None else f"{reward:.3f}",
            f"{r['spent_dollars']:.4f}",
            _when(r["created_at"]),
        )
    return t


def run_details(run: dict[str, Any]) -> Group:
    """``spotrl runs get``: the progress view and what else a person asks of a run."""
    spec = run["spec"]
    facts = Table.grid(padding=(0, 2))
    for label, value in [
        ("name", run["name"] or "-"),
        ("tenant", run["tenant"]),
        ("model", f"{spec['model']} ({spec['algorithm']})"),
        ("prompts", f"{run['prompt_count']} ({spec['prompts']})"),
        ("created / started / ended", " / ".join(_when(run[k]) for k in ("created_at", "started_at", "ended_at"))),
        ("status reason", run["status_reason"] or "-"),
        ("last error", run.get("last_error") or "-"),
    ]:
        facts.add_row(label, str(value))
    return Group(facts, run_progress(run))


def watch_run(
    fetch: Callable[[], dict[str, Any]],
    run: dict[str, Any],
    *,
    console: Console,
    interval_s: float = 1.0,
    on_interrupt: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Show ``run`` live, fetching it every ``interval_s`` until it ends; returns it as it ended.

    On Ctrl-C: with ``on_interrupt`` (the demo cancels its run), call it and keep showing the
    run until it ends; without, stop watching (KeyboardInterrupt goes up) and leave the run be.
    """
    latest = run
    with Live(run_progress(run), console=console, refresh_per_second=2) as live:

        def follow() -> dict[str, Any]:
            nonlocal latest
            while not RunStatus(latest["status"]).is_terminal():
                time.sleep(interval_s)
                latest = fetch()
                live.update(run_progress(latest))
            return latest

        try:
            return follow()
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            on_interrupt(latest)
            return follow()
