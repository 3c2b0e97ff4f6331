"""A run's cost as it accrued: the ledger's figures at each instant of the run. Pure, no I/O.

Every figure of ``services.control.cost.report`` grows linearly between the instants where a pod starts or
ends (and always-on also from the run's start), so its value at those instants, joined by
straight lines, is its whole curve: ``cost_over_time`` evaluates ``cost_report`` on the ledger as
it stood at each of them, the same arithmetic as the run's final bill.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.control.cost.billing import billed_dollars
from services.control.cost.report import CostReport, cost_report
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import LedgerEntry

# More pods than this many instants (a long run's thousands of workers) are drawn from as many
# evenly spaced instants: a picture of the curve, no longer every corner of it.
# It costs a ``cost_report`` per instant (entries x instants of work: ~1 s for 2000 pods).
MAX_INSTANTS = 200


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


def instants(entries: Sequence[LedgerEntry], *, run_started_at: float | None, end: float) -> list[float]:
    """Where the curves bend: the run's start, every pod's start and end, and ``end``, in order."""
    points = {end, *(e.started_at for e in entries), *(e.ended_at for e in entries if e.ended_at is not None)}
    if run_started_at is not None:
        points.add(run_started_at)
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
    training_instance_type: str,
    run_started_at: float | None,
    run_ended_at: float | None,
    now: float,
) -> list[CostAt]:
    """The run's cost figures at each instant of ``instants``, up to the run's end (or ``now``)."""
    end = run_ended_at if run_ended_at is not None else now
    curve = []
    for at in instants(entries, run_started_at=run_started_at, end=end):
        ledger = ledger_at(entries, at, now)
        by_key: dict[tuple[str, str], float] = defaultdict(float)
        for e, dollars in zip(ledger, billed_dollars(ledger, catalog, at), strict=True):
            by_key[(e.role, e.capacity_type)] += dollars  # billed as the report bills it
        report = cost_report(
            ledger,
            catalog=catalog,
            training_instance_type=training_instance_type,
            run_started_at=run_started_at,
            run_ended_at=at,
            now=at,
        )
        curve.append(CostAt(at=at, report=report, by_role_and_capacity=dict(by_key)))
    return curve
