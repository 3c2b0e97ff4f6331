"""A run's cost as it accrued: the ledger's figures at each instant of the run. Pure, no I/O.

A provider charges a machine's billing minimum the moment it starts, then nothing more until
the minimum has passed, then per second (``services.control.cost.billing``). So every figure
of ``services.control.cost.report`` steps up at a pod's start (by the minimum's charge: drawn
as a point at the start and one ``STEP_SECONDS`` later), stays flat until the minimum is used
up, and grows linearly from there until another pod starts or ends. Its value at those
instants, joined by straight lines, is its whole curve (a per-started-minute rule's staircase
is drawn as its slope): ``cost_over_time`` evaluates ``cost_report`` on the ledger as it stood
at each of them, the same arithmetic as the run's final bill.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.control.cost.billing import ONE_GPU_PER_WORKER, RolloutTerms, billed_dollars, rule_for
from services.control.cost.lower_bound import TrainingTerms
from services.control.cost.report import CostReport, cost_report
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import LedgerEntry

# More pods than this many instants (a long run's thousands of workers) are drawn from as many
# evenly spaced instants: a picture of the curve, no longer every corner of it.
# It costs a ``cost_report`` per instant (entries x instants of work: ~1 s for 2000 pods).
MAX_INSTANTS = 200
# How long after a pod's start the curve shows its minimum owed: a vertical step on any chart,
# yet after the start, where a provider has billed it (a machine that ran no time is billed nothing).
STEP_SECONDS = 1e-3


@dataclass(frozen=True)
class CostAt:
    """The run's cost figures up to ``at`` (unix seconds)."""

    at: float
    report: CostReport
    by_role_and_capacity: dict[tuple[str, str], float]  # (role, capacity type) -> dollars


def ledger_at(entries: Sequence[LedgerEntry], at: float, now: float) -> list[LedgerEntry]:
    """The ledger as it stood at ``at``: pods started by then, billed up to ``at`` at the latest."""
    clipped = []
    for e in entries:
        if e.started_at > at:
            continue
        ended = now if e.ended_at is None else e.ended_at
        clipped.append(e if ended <= at and e.ended_at is not None else replace(e, ended_at=min(ended, at)))
    return clipped


def instants(
    entries: Sequence[LedgerEntry],
    *,
    catalog: PriceCatalog,
    training: TrainingTerms,
    run_started_at: float | None,
    end: float,
) -> list[float]:
    """Where the curves bend, in order: the run's start and every pod's start, ``STEP_SECONDS``
    after each (its minimum owed), where each one's billing minimum runs out (always-on's
    training instance's from the run's start), every pod's end, and ``end``."""

    def minimum(instance_type: str) -> float:
        return rule_for(catalog.get(instance_type).provider).minimum_seconds

    points = {end, *(e.ended_at for e in entries if e.ended_at is not None)}
    for e in entries:
        points |= {e.started_at, e.started_at + STEP_SECONDS}
        if e.ended_at is None or e.started_at + minimum(e.instance_type) < e.ended_at:
            points.add(e.started_at + minimum(e.instance_type))
    if run_started_at is not None:
        points |= {run_started_at, run_started_at + STEP_SECONDS, run_started_at + minimum(training.instance_type)}
    ordered = sorted(p for p in points if p <= end)
    if len(ordered) <= MAX_INSTANTS:
        return ordered
    first = ordered[0]
    step = (end - first) / (MAX_INSTANTS - 1)
    return [first + i * step for i in range(MAX_INSTANTS - 1)] + [end]


def cost_over_time(
    entries: Sequence[LedgerEntry],
    *,
    catalog: PriceCatalog,
    training: TrainingTerms,
    rollout: RolloutTerms = ONE_GPU_PER_WORKER,
    run_started_at: float | None,
    run_ended_at: float | None,
    now: float,
) -> list[CostAt]:
    """The run's cost figures at each instant of ``instants``, up to the run's end (or ``now``)."""
    end = run_ended_at if run_ended_at is not None else now
    curve = []
    points = instants(entries, catalog=catalog, training=training, run_started_at=run_started_at, end=end)
    for at in points:
        ledger = ledger_at(entries, at, now)
        by_key: dict[tuple[str, str], float] = defaultdict(float)
        for e, dollars in zip(ledger, billed_dollars(ledger, catalog, at), strict=True):
            by_key[(e.role, e.capacity_type)] += dollars  # billed as the report bills it
        report = cost_report(
            ledger,
            catalog=catalog,
            training=training,
            rollout=rollout,
            run_started_at=run_started_at,
            run_ended_at=at,
            now=at,
        )
        curve.append(CostAt(at=at, report=report, by_role_and_capacity=dict(by_key)))
    return curve
