"""``spotrl simulate`` with a deadline on a shipped spot trace: the looser the deadline, the less
on-demand rollout the run buys, and every deadline is met."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.control.simulate.traces import load_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy

# One spot A100 node, none from 9.9 h to 11.2 h (SpotHedge's GCP traces, ../shared/traces/README.md).
TRACE = (
    Path(__file__).resolve().parents[4].parent
    / "shared"
    / "traces"
    / "spothedge-gcp-a100"
    / "asia-northeast1-a_a100_40gb_8.json"
)
DEADLINES_H = (5.5, 12.0, 24.0, 48.0)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared spot traces are not beside the repository")
def test_cost_falls_as_the_deadline_loosens_and_every_deadline_is_met() -> None:
    trace = load_trace(TRACE)
    runs = [simulate(trace, CostPolicy.COST_AWARE, Workload(deadline_hours=h)) for h in DEADLINES_H]
    assert all(r.deadline_met for r in runs)
    assert all(r.samples_trained == 12 * 5000 for r in runs)
    dollars = [r.dollars for r in runs]
    assert dollars == sorted(dollars, reverse=True) and dollars[0] - dollars[-1] > 5.0
    # A 48 h deadline leaves room for the spot-only run (no deadline): it costs what that one does, within 1%.
    spot_only = simulate(trace, CostPolicy.COST_AWARE, Workload())
    assert dollars[-1] <= 1.01 * spot_only.dollars
