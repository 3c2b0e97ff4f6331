"""A run's report as one self-contained HTML page: reward by iteration (and the held-out eval
scores by policy version, where the run has evals), cumulative cost against always-on and the
lower bound, and the rollout and training timelines with preemptions marked.

Pure: the run's records in, a string out. The page loads nothing (inline SVG, inline CSS, no
script; its Content-Security-Policy forbids any fetch), so it works offline and from a file.
It shows no text a client wrote (no run name, no prompt): ids, numbers and the operator's catalog
names only, and even those are escaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

from services.control.cost.billing import ONE_GPU_PER_WORKER, RolloutTerms
from services.control.cost.cost_over_time import cost_over_time
from services.control.cost.lower_bound import LOWER_BOUND_DEFINITION, TrainingTerms
from services.control.cost.report import cost_report
from services.control.cost.svg_charts import Bar, Series, line_chart, number, timeline_chart
from services.ports.launcher.launcher import PodOutcome
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import LedgerEntry

REWARD_COLOR = "#6a3d9a"
# The held-out eval's metrics (mean first, then each pass@k), dashed beside the training reward.
EVAL_COLORS = ("#1b9e77", "#d95f02", "#e7298a", "#66a61e")
CAPACITY_COLORS = {"spot": "#2b8cbe", "on-demand": "#e6550d"}
OTHER_CAPACITY_COLOR = "#999999"
SPENT_COLOR = "#111111"
SPENT_DASH = "14 4 3 4"  # dash-dot: never taken for a (role, capacity type) line, which are solid
ALWAYS_ON_COLOR = "#b2182b"
LOWER_BOUND_COLOR = "#1a9850"
# The (role, capacity type) lines of the cost chart, in the order they are first met: none of
# them near spent's, always-on's or the lower bound's colour.
SERIES_COLORS = ("#2b8cbe", "#e6550d", "#756bb1", "#e7ba52", "#17becf", "#8c564b")
TIME_LABEL = "time since the run started (s)"
# What the savings figure compares, under the summary.
SAVINGS_NOTE = (
    "cheaper than always-on (Nx) = what an always-on on-demand cluster would have cost for the same wall time "
    "(the training instance held throughout, the rollout and eval work on-demand) / what the run spent; "
    "on a very short run each pod's billing minimum (60 s on AWS and GCP) dominates both"
)
CSP = "default-src 'none'; style-src 'unsafe-inline'"
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; color: #222; margin: 24px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 8px; }
table.summary td { padding: 2px 12px 2px 0; }
p.note { margin: 4px 0; color: #555; }
figure { margin: 24px 0; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.chart text { font: 12px system-ui, sans-serif; }
"""


@dataclass(frozen=True)
class IterationPoint:
    iteration: int
    mean_reward: float


@dataclass(frozen=True)
class EvalPoint:
    """A policy version's held-out eval: version N is what iteration N trained (0: the base model)."""

    policy_version: int
    metrics: Mapping[str, float]  # `mean` and the spec's pass@k


def report_page(
    *,
    run_id: str,
    status: str,
    currency: str,
    iterations: Sequence[IterationPoint],
    entries: Sequence[LedgerEntry],
    catalog: PriceCatalog,
    training: TrainingTerms,
    rollout: RolloutTerms = ONE_GPU_PER_WORKER,
    run_started_at: float | None,
    run_ended_at: float | None,
    now: float,
    evals: Sequence[EvalPoint] = (),
) -> str:
    """The report page of run ``run_id`` from its iterations, held-out evals and ledger, as of ``now``."""
    start = run_started_at if run_started_at is not None else min((e.started_at for e in entries), default=now)
    end = run_ended_at if run_ended_at is not None else now
    report = cost_report(
        entries,
        catalog=catalog,
        training=training,
        rollout=rollout,
        run_started_at=run_started_at,
        run_ended_at=run_ended_at,
        now=now,
    )
    summary = [
        ("status", status),
        ("wall time", f"{number(report.wall_seconds)} s"),
        ("spent", f"{report.total_dollars:.4f} {currency}"),
        ("always-on on-demand", f"{report.always_on_dollars:.4f} {currency}"),
        ("lower bound", f"{report.lower_bound_dollars:.4f} {currency}"),
        ("cheaper than always-on", "-" if report.savings_ratio is None else f"{report.savings_ratio:.2f}x"),
        ("lower bound / spent", "-" if report.efficiency is None else f"{report.efficiency:.2f}"),
    ]
    figures = [
        (
            "reward",
            "Mean reward by iteration" + (", held-out eval by policy version" if evals else ""),
            reward_chart(iterations, evals),
        ),
        (
            "cost",
            "Cumulative cost, billed as charged (each pod's minimum at its start)",
            cost_chart(
                entries,
                catalog=catalog,
                currency=currency,
                training=training,
                rollout=rollout,
                run_started_at=run_started_at,
                run_ended_at=run_ended_at,
                now=now,
                start=start,
            ),
        ),
        (
            "rollout-timeline",
            "Rollout workers",
            pod_timeline(
                "rollout-timeline", [e for e in entries if e.role != "training"], start=start, end=end, now=now
            ),
        ),
        (
            "training-timeline",
            "Training jobs",
            pod_timeline(
                "training-timeline", [e for e in entries if e.role == "training"], start=start, end=end, now=now
            ),
        ),
    ]
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in summary)
    notes = "".join(f'<p class="note">{escape(line)}</p>' for line in (SAVINGS_NOTE, LOWER_BOUND_DEFINITION))
    body = "".join(
        f'<figure id="{fid}"><figcaption>{escape(caption)}</figcaption>{svg}</figure>' for fid, caption, svg in figures
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>spotrl report {escape(run_id)}</title><style>{_STYLE}</style></head><body>"
        f'<h1>spotrl run {escape(run_id)}</h1><table class="summary">{rows}</table>{notes}{body}</body></html>\n'
    )


def reward_chart(iterations: Sequence[IterationPoint], evals: Sequence[EvalPoint] = ()) -> str:
    """The training samples' mean reward by iteration; with ``evals``, a dashed line per eval
    metric by policy version beside it (the same axis: version N is iteration N's)."""
    points = [(float(it.iteration), it.mean_reward) for it in iterations]
    series = [Series("mean reward", points, REWARD_COLOR, markers=True)]
    names = list(dict.fromkeys(name for e in evals for name in e.metrics))
    series += [
        Series(
            f"held-out {name}",
            [(float(e.policy_version), e.metrics[name]) for e in evals if name in e.metrics],
            EVAL_COLORS[i % len(EVAL_COLORS)],
            dash="6 4",
            markers=True,
        )
        for i, name in enumerate(names)
    ]
    if not evals:
        return line_chart(
            "reward", series, x_label="iteration", y_label="mean reward", empty="no iteration finished yet"
        )
    return line_chart(
        "reward",
        series,
        x_label="iteration (= policy version)",
        y_label="mean reward / eval score",
        empty="no iteration finished yet",
    )


def cost_chart(
    entries: Sequence[LedgerEntry],
    *,
    catalog: PriceCatalog,
    currency: str,
    training: TrainingTerms,
    rollout: RolloutTerms = ONE_GPU_PER_WORKER,
    run_started_at: float | None,
    run_ended_at: float | None,
    now: float,
    start: float,
) -> str:
    """Money spent so far per (role, capacity type) (solid lines) and in all (dash-dot), against
    always-on and the lower bound, over the seconds since the run started; a legend names each
    line, the y axis the currency."""
    curve = cost_over_time(
        entries,
        catalog=catalog,
        training=training,
        rollout=rollout,
        run_started_at=run_started_at,
        run_ended_at=run_ended_at,
        now=now,
    )
    keys = list(dict.fromkeys((e.role, e.capacity_type) for e in entries))
    series = [
        Series(
            f"{role} {capacity}",
            [(c.at - start, c.by_role_and_capacity.get((role, capacity), 0.0)) for c in curve],
            SERIES_COLORS[i % len(SERIES_COLORS)],
        )
        for i, (role, capacity) in enumerate(keys)
    ]
    series += [
        Series("spent", [(c.at - start, c.report.total_dollars) for c in curve], SPENT_COLOR, dash=SPENT_DASH),
        Series(
            "always-on on-demand",
            [(c.at - start, c.report.always_on_dollars) for c in curve],
            ALWAYS_ON_COLOR,
            dash="8 5",
        ),
        Series(
            "lower bound", [(c.at - start, c.report.lower_bound_dollars) for c in curve], LOWER_BOUND_COLOR, dash="3 3"
        ),
    ]
    return line_chart("cost", series, x_label=TIME_LABEL, y_label=f"cost ({currency})", empty="no pod billed yet")


def pod_timeline(name: str, entries: Sequence[LedgerEntry], *, start: float, end: float, now: float) -> str:
    """A row per pod (its name less the run id), a bar per ledger entry coloured by capacity type,
    a cross where the pod was preempted."""
    bars = [
        Bar(
            row=e.pod.removeprefix(f"{e.run_id}-"),
            start=e.started_at - start,
            end=(e.ended_at if e.ended_at is not None else now) - start,
            color=CAPACITY_COLORS.get(e.capacity_type, OTHER_CAPACITY_COLOR),
            kind=e.capacity_type,
            title=f"{e.pod} {e.instance_type} {e.capacity_type}: {number(e.seconds(now))} s, {e.outcome or 'running'}",
            marked=e.outcome == PodOutcome.PREEMPTED,
        )
        for e in entries
    ]
    capacities = list(dict.fromkeys(e.capacity_type for e in entries))
    legend = [(c, CAPACITY_COLORS.get(c, OTHER_CAPACITY_COLOR)) for c in capacities]
    return timeline_chart(name, bars, x_range=(0.0, max(end - start, 0.0)), x_label=TIME_LABEL, legend=legend)
