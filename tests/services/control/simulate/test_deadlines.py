"""``spotrl simulate`` with a deadline on the shipped spot traces: the looser the deadline, the less
the run costs (it waits for spot as long as the deadline allows, and what on-demand rollout it buys
keeps the trainer busy), every deadline is met, and a loose one costs what no deadline does."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from services.control.simulate.traces import load_trace
from services.control.simulate.world import SimResult, Workload, simulate
from services.domain.runspec import CostPolicy

TRACES = Path(__file__).resolve().parents[4].parent / "shared" / "traces"
# Two traces of each kind (SpotHedge's GCP traces, ../shared/traces/README.md): some spot, one node
# with an outage (asia-northeast1-a); none at all (us-east1-b) and none for 15 h (us-west1-b).
NAMES = ("asia-northeast1-a", "us-central1-a", "us-east1-b", "us-west1-b")
DEADLINES_H = (5.5, 12.0, 24.0, 48.0)
# Cents of start-up timing between two runs that buy the same on-demand pool at different hours.
NOISE = 0.002


def _run(args: tuple[Path, float | None]) -> SimResult:
    path, hours = args
    return simulate(load_trace(path), CostPolicy.COST_AWARE, Workload(deadline_hours=hours))


@pytest.mark.skipif(not TRACES.exists(), reason="the shared spot traces are not beside the repository")
def test_cost_never_rises_as_the_deadline_loosens_and_every_deadline_is_met() -> None:
    paths = [TRACES / "spothedge-gcp-a100" / f"{name}_a100_40gb_8.json" for name in NAMES]
    jobs = [(path, h) for path in paths for h in (*DEADLINES_H, None)]
    with ProcessPoolExecutor(min(len(jobs), 8)) as pool:
        results = list(pool.map(_run, jobs))
    for i, name in enumerate(NAMES):
        *runs, spot_only = results[i * 5 : i * 5 + 5]
        assert all(r.deadline_met and r.samples_trained == 12 * 5000 for r in runs), name
        dollars = [r.dollars for r in runs]
        assert all(later <= earlier * (1 + NOISE) for earlier, later in zip(dollars, dollars[1:], strict=False)), (
            name,
            dollars,
        )
        if spot_only.finished and spot_only.wall_seconds < 0.5 * 48 * 3600:
            # A deadline twice the spot-only run's time buys nothing: it costs what no deadline does.
            assert dollars[-1] <= spot_only.dollars * (1 + NOISE), (name, dollars, spot_only.dollars)
        else:
            # No spot run meets it in time (or at all): the loosest deadline costs at most an
            # on-demand-rollout run's (the 5.5 h one's) and, where spot finishes, within 2% of it.
            assert dollars[-1] <= dollars[0] * (1 + NOISE)
            assert not spot_only.finished or dollars[-1] <= 1.02 * spot_only.dollars, (name, dollars, spot_only.dollars)
