"""A run's cost report, computed from its ledger: pure arithmetic, no I/O.

Three figures, so a user can judge the bill:

- ``total_dollars``: what the run spent: every pod it started, billed by its provider's rule
  (``services.control.cost.billing``: per second with a 60 s minimum on AWS, for instance).
- ``always_on_dollars``: the same work on an always-on on-demand cluster: the training
  instance (each of a job's ``training.nodes``) held on-demand for the run's whole wall time, and
  the rollout and eval work billed at the on-demand price of its instance type instead of spot (by
  the same billing rules; a worker of some of its node's GPUs at that share of it: ``RolloutTerms``).
  A run of many jobs much shorter than the provider's minimum can cost more than this.
- ``lower_bound_dollars``: ``services.control.cost.lower_bound``'s, with each pod's ledger
  seconds as its busy seconds: rollout, eval and reward at their cheapest (spot) price,
  training on-demand, a standby's idle node at nothing, no billing minimum.

All in ``currency``: the one currency of the run's instance types (a run mixing currencies
is refused when it is submitted: ``PriceCatalog.currency_of``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from services.control.cost.billing import ONE_GPU_PER_WORKER, RolloutTerms, billed_dollars, billed_seconds, rule_for
from services.control.cost.lower_bound import TrainingTerms, ledger_busy, lower_bound_dollars
from services.domain.names import ROLE_EVAL, ROLE_ROLLOUT
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import LedgerEntry


@dataclass(frozen=True)
class CostReport:
    currency: str
    total_dollars: float
    by_role: dict[str, float]
    by_capacity_type: dict[str, float]
    wall_seconds: float
    always_on_dollars: float
    lower_bound_dollars: float

    @property
    def savings_ratio(self) -> float | None:
        """How many times cheaper than always-on (2.0 = half the price)."""
        return self.always_on_dollars / self.total_dollars if self.total_dollars > 0 else None

    @property
    def efficiency(self) -> float | None:
        """Lower bound over spent: 1.0 means nothing was paid for idle or expensive capacity."""
        return self.lower_bound_dollars / self.total_dollars if self.total_dollars > 0 else None


def spent_dollars(entries: Sequence[LedgerEntry], catalog: PriceCatalog, now: float) -> float:
    """What the run has spent up to ``now``: the report's ``total_dollars``, every entry billed by
    its provider's rule. Every "spent" a person reads (a run's, the list's, the budget's) is this."""
    return sum(billed_dollars(entries, catalog, now))


def cost_report(
    entries: Sequence[LedgerEntry],
    *,
    catalog: PriceCatalog,
    training: TrainingTerms,
    rollout: RolloutTerms = ONE_GPU_PER_WORKER,
    run_started_at: float | None,
    run_ended_at: float | None,
    now: float,
) -> CostReport:
    by_role: dict[str, float] = defaultdict(float)
    by_capacity: dict[str, float] = defaultdict(float)
    rollout_on_demand = 0.0
    billed = billed_dollars(entries, catalog, now)  # spent_dollars's terms, billed once for both uses
    for e, dollars in zip(entries, billed, strict=True):
        by_role[e.role] += dollars
        by_capacity[e.capacity_type] += dollars
        price = catalog.get(e.instance_type)
        seconds = e.seconds(now)
        # Rollout and eval pods at on-demand prices; training and its standby (warm node) are the training
        # instance's, counted below.
        if e.role in (ROLE_ROLLOUT, ROLE_EVAL):
            on_demand = price.on_demand * rollout.share(e.role, price)  # its share of the node
            rollout_on_demand += billed_seconds(seconds, rule_for(price.provider)) * on_demand / 3600.0
    wall = 0.0 if run_started_at is None else max(0.0, (run_ended_at or now) - run_started_at)
    node = catalog.get(training.instance_type)
    # Billed by the same rules as the run: one launch of the training nodes, held throughout.
    always_on = (
        billed_seconds(wall, rule_for(node.provider)) * node.on_demand * training.nodes / 3600.0 + rollout_on_demand
    )
    return CostReport(
        currency=catalog.currency_of([training.instance_type, *(e.instance_type for e in entries)]),
        total_dollars=sum(billed),  # spent_dollars(entries, catalog, now)
        by_role=dict(by_role),
        by_capacity_type=dict(by_capacity),
        wall_seconds=wall,
        always_on_dollars=always_on,
        lower_bound_dollars=lower_bound_dollars(ledger_busy(entries, catalog, now, rollout), training.spot),
    )
