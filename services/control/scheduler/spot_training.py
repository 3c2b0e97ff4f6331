"""On which capacity a run's next training job starts: the spec's ``training.capacity`` rule.

- ``on-demand``: always on-demand.
- ``spot``: always spot. The job checkpoints within its update (every ``checkpoint_every_s`` and
  at the provider's preemption notice); a preempted job is started again and resumes from its
  checkpoint, and a job waits for a spot node as long as none comes.
- ``auto``: spot while its expected cost is below on-demand's. A second of update on spot costs
  the spot price, plus, for each preemption expected in that second, a restart's start-up and
  half a checkpoint interval of lost update (a kill without notice; with one, the job checkpoints
  before it goes); on-demand, the on-demand price. The preemption rate is what the run's spot
  training pods have met so far, with an hour on spot without one as the prior.

Where: a spot job (or standby) goes to the cheapest of ``training.spot_zones`` (any zone when none
is listed) not given up in the past ``SPOT_RETRY_AFTER_SECONDS``. One that waits for a node longer
than two start-ups is stopped and its zone given up: the next job tries the next zone. Once every
zone is given up, ``auto`` trains on-demand until the first comes back (a node that does not come
costs the run its wall time, the one thing on-demand buys back), but not while the run's spot
rollout workers all wait for nodes too, when the next batch waits as long; ``spot`` waits on in the
last zone it tries (and after a preemption starts in the zone given up longest ago).

Pure functions of what ``plan`` observes; the simulator (``services.control.simulate``) decides with
them too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from contracts.training import TrainingCapacity
from services.control.scheduler.policies import Estimates
from services.domain.names import ROLE_TRAINING
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodStatus
from services.ports.state.state_store import LedgerEntry

# A spot zone given up (no training node came there in time) is not tried again for this long.
SPOT_RETRY_AFTER_SECONDS = 7200.0
# The preemption rate's prior: this many seconds on spot without a preemption.
PRIOR_SPOT_SECONDS = 3600.0
# A spot training job that waits for a node this many start-ups gives its zone up.
PATIENCE_STARTUPS = 2.0


@dataclass(frozen=True)
class SpotTrainingRecord:
    """The run's spot training so far, from its ledger: the pods preempted and their seconds held."""

    preemptions: int = 0
    seconds: float = 0.0

    @classmethod
    def of(cls, ledger: Iterable[LedgerEntry], now: float) -> SpotTrainingRecord:
        spot = [e for e in ledger if e.role == ROLE_TRAINING and e.capacity_type == "spot"]
        return cls(
            preemptions=sum(e.outcome == PodOutcome.PREEMPTED.value for e in spot),
            seconds=sum(e.seconds(now) for e in spot),
        )

    @property
    def preemptions_per_second(self) -> float:
        return self.preemptions / (self.seconds + PRIOR_SPOT_SECONDS)


@dataclass(frozen=True)
class TrainingPrices:
    """The training instance type's prices per hour now: its spot price in each spot zone
    (``spot_zones``; live or the trace's where known, else the catalog's) and the catalog's on-demand price."""

    spot: tuple[float, ...]
    on_demand: float


ANY_ZONE = ""  # the one spot zone of a run that lists none: wherever the cluster finds a node


def spot_zones(spec: RunSpec) -> list[str]:
    """Where the run's spot training jobs may go: ``training.spot_zones``, or any zone."""
    return list(spec.training.spot_zones) or [ANY_ZONE]


def open_zones(spec: RunSpec, refusals: Mapping[str, float], now: float) -> list[int]:
    """The spot zones (their indexes in ``spot_zones``) not given up in the past ``SPOT_RETRY_AFTER_SECONDS``."""
    return [
        i for i, zone in enumerate(spot_zones(spec)) if now - refusals.get(zone, -math.inf) >= SPOT_RETRY_AFTER_SECONDS
    ]


def spot_zone(
    spec: RunSpec,
    now: float,
    refusals: Mapping[str, float],
    estimates: Estimates,
    prices: TrainingPrices | None,
    record: SpotTrainingRecord,
) -> int | None:
    """The spot zone (its index in ``spot_zones``) the next training job (or the standby that holds
    its node) starts in; None: on-demand."""
    capacity = spec.training.capacity
    if capacity == TrainingCapacity.ON_DEMAND:
        return None
    zones = spot_zones(spec)
    price = (lambda i: prices.spot[i]) if prices is not None else (lambda i: 0.0)
    candidates = open_zones(spec, refusals, now)
    if capacity == TrainingCapacity.SPOT:
        if not candidates:  # every zone given up: the one given up longest ago
            return min(range(len(zones)), key=lambda i: refusals.get(zones[i], -math.inf))
        return min(candidates, key=price)
    if not candidates or prices is None:
        return None  # nowhere to try, or no price to weigh: the spec's safe side
    zone = min(candidates, key=price)
    lost_per_preemption = estimates.startup_seconds + spec.training.checkpoint_every_s / 2
    spot_seconds_per_second = 1 + record.preemptions_per_second * lost_per_preemption
    return zone if prices.spot[zone] * spot_seconds_per_second < prices.on_demand else None


def spot_wait_expired(pod: PodStatus, now: float, estimates: Estimates) -> bool:
    """A spot training (or standby) pod has waited for a node past its patience, and never had one
    (or, of several nodes, never had them all)."""
    return (
        pod.capacity_type == "spot"
        and _short_of_nodes(pod)
        and now - pod.started_at > PATIENCE_STARTUPS * estimates.startup_seconds
    )


def _short_of_nodes(pod: PodStatus) -> bool:
    """No node has held the pod, or not all of its several have: it has not started."""
    return (pod.waiting_for_node and pod.node_joined_at is None) or pod.partly_placed


def give_up_zone(spec: RunSpec, zone: int, refusals: Mapping[str, float], now: float, rollout_stalled: bool) -> bool:
    """Whether a spot job whose wait in ``zone`` expired is stopped and its zone given up: while
    another zone is open, it is tried there; the last open one is given up by ``auto`` only (it
    trains on-demand then), and not while the run's spot rollout workers all wait for nodes too (an
    outage of both, likely of one zone), when the next batch is as late as the job."""
    if any(i != zone for i in open_zones(spec, refusals, now)):
        return True
    return spec.training.capacity == TrainingCapacity.AUTO and not rollout_stalled


def spot_loss(pod: PodStatus) -> bool:
    """A training pod that ended by no fault of its own: preempted, or stopped before its nodes held
    it. Its iteration starts again without counting a failure."""
    return pod.preempted or _short_of_nodes(pod)
