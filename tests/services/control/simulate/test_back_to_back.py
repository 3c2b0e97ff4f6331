"""Back-to-back jobs in the simulator and the oracle: where spot rollout is scarce, cost-aware lets a
complete batch wait for the next and trains both on one node (the second batch one version old,
within the staleness bound), paying about half the start-ups at the same wall time; the oracle
has the same lever, so it stays the cheaper."""

from __future__ import annotations

from dataclasses import replace

from services.control.simulate.oracle import oracle
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy
from tests.services.control.simulate.trace_shapes import ONE_NODE_OUTAGE

# One spot node at a time: a batch every 100 minutes, an 18-minute job.
SCARCE = replace(Workload(), iterations=9)


def test_scarce_spot_trains_its_batches_in_pairs() -> None:
    threshold = simulate(ONE_NODE_OUTAGE, CostPolicy.THRESHOLD, SCARCE)
    paired = simulate(ONE_NODE_OUTAGE, CostPolicy.COST_AWARE, SCARCE)
    assert paired.finished and paired.samples_trained == threshold.samples_trained == 9 * 5000
    assert paired.samples_dropped_stale == 0  # the second batch of a pair is one version old
    # The first job (no pace measured yet) and each pair's first start cold: 5 start-ups of 9,
    # where threshold pays one a job.
    startup = SCARCE.startup_seconds * 21.96 / 3600  # p4d.24xlarge on-demand
    assert paired.gap["train_startup"] <= 5.5 * startup
    assert threshold.gap["train_startup"] >= 8.5 * startup
    assert paired.dollars < threshold.dollars
    assert paired.wall_seconds <= 1.05 * threshold.wall_seconds
    # With a staleness bound of 0 a second batch could not wait: every job starts cold.
    fresh = simulate(ONE_NODE_OUTAGE, CostPolicy.COST_AWARE, replace(SCARCE, staleness_bound=0))
    assert fresh.gap["train_startup"] >= 8.5 * startup


def test_the_oracle_pairs_too_and_stays_the_cheaper() -> None:
    best = oracle(ONE_NODE_OUTAGE, SCARCE)
    assert best.new_nodes <= 5
    paired = [(a, b) for a, b in zip(best.batches, best.batches[1:], strict=False) if a.new_node and not b.new_node]
    assert paired and all(b.job_start == a.job_end for a, b in paired)  # back to back on one node
    assert best.dollars <= simulate(ONE_NODE_OUTAGE, CostPolicy.COST_AWARE, SCARCE).dollars
