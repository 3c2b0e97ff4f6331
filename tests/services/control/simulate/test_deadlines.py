"""``spotrl simulate`` with a deadline on spot traces of the shipped kinds: the looser the deadline, the less
the run costs (it waits for spot as long as the deadline allows, and what on-demand rollout it buys
keeps the trainer busy), every deadline is met, and a loose one costs what no deadline does."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from services.control.simulate.traces import SpotTrace
from services.control.simulate.world import SimResult, Workload, simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.trace_shapes import FOUR_NODES, LATE_SPOT, NO_SPOT, ONE_NODE_OUTAGE

# Two traces of each kind: some spot (one node with an outage; four nodes), none at all, none for 15 h.
TRACES = (ONE_NODE_OUTAGE, FOUR_NODES, NO_SPOT, LATE_SPOT)
DEADLINES_H = (5.5, 12.0, 24.0, 48.0)
# Cents of start-up timing between two runs that buy the same on-demand pool at different hours.
NOISE = 0.002


def _run(args: tuple[SpotTrace, float | None]) -> SimResult:
    trace, hours = args
    return simulate(trace, CostPolicy.COST_AWARE, Workload(deadline_hours=hours))


def test_cost_never_rises_as_the_deadline_loosens_and_every_deadline_is_met() -> None:
    jobs = [(trace, h) for trace in TRACES for h in (*DEADLINES_H, None)]
    with ProcessPoolExecutor(min(len(jobs), 8)) as pool:
        results = list(pool.map(_run, jobs))
    for i, trace in enumerate(TRACES):
        name = trace.name
        *runs, spot_only = results[i * 5 : i * 5 + 5]
        first_spot = next((t * trace.gap_seconds for t, n in enumerate(trace.available) if n), None)
        assert all(r.deadline_met and r.samples_trained == 12 * 5000 for r in runs), name
        dollars = [r.dollars for r in runs]
        assert all(later <= earlier * (1 + NOISE) for earlier, later in zip(dollars, dollars[1:], strict=False)), (
            name,
            dollars,
        )
        if spot_only.finished and spot_only.wall_seconds < 0.5 * 48 * 3600 and first_spot < 0.25 * 48 * 3600:
            # A deadline twice the spot-only run's time buys nothing: it costs what no deadline does.
            # (Where no spot comes within a quarter of the deadline, one on-demand worker measures
            # the rate, and the case below holds instead.)
            assert dollars[-1] <= spot_only.dollars * (1 + NOISE), (name, dollars, spot_only.dollars)
        else:
            # No spot run meets it in time (or at all): the loosest deadline costs at most an
            # on-demand-rollout run's (the 5.5 h one's) and, where spot finishes, within 2% of it.
            assert dollars[-1] <= dollars[0] * (1 + NOISE)
            assert not spot_only.finished or dollars[-1] <= 1.02 * spot_only.dollars, (name, dollars, spot_only.dollars)
