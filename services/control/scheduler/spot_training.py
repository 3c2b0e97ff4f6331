"""On which capacity a run's next training job starts: the spec's ``training.capacity`` rule.

- ``on-demand``: always on-demand.
- ``spot``: always spot. The job checkpoints within its update (every ``checkpoint_every_s`` and
  at the provider's preemption notice); a preempted job is started again and resumes from its
  checkpoint, and a job waits for a spot node as long as none comes.
- ``auto``: spot while its expected cost is below on-demand's. A job's expected cost on spot is
  the spot price over its time plus, for each preemption expected in that time, a restart's
  start-up and half a checkpoint interval of lost update (a kill without notice; with one, the
  job checkpoints before it goes); on-demand is the on-demand price over the job's time. The
  preemption rate is what the run's spot training pods have met so far, with an hour on spot
  without one as the prior. A spot job (or standby) that waits for a node longer than two
  start-ups is stopped and the run's jobs go on-demand for ``SPOT_RETRY_AFTER_SECONDS``: a node
  that does not come costs the run its wall time, the one thing on-demand buys back; but not
  while the run's spot rollout workers all wait for nodes too, when the next batch waits as long.

Pure functions of what ``plan`` observes; the simulator (``services.control.simulate``) decides with
them too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from contracts.training import TrainingCapacity
from services.control.scheduler.policies import Estimates
from services.domain.names import ROLE_TRAINING
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodStatus
from services.ports.state.state_store import LedgerEntry

# After an auto run gave up waiting for a spot training node, its jobs go on-demand this long.
SPOT_RETRY_AFTER_SECONDS = 7200.0
# The preemption rate's prior: this many seconds on spot without a preemption.
PRIOR_SPOT_SECONDS = 3600.0
# A spot training job that waits for a node this many start-ups is given up (auto only).
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
    """The training instance type's price per hour now: its spot price (live or the trace's where
    known, else the catalog's) and the catalog's on-demand price."""

    spot: float
    on_demand: float


def train_on_spot(
    spec: RunSpec,
    now: float,
    refused_at: float | None,
    estimates: Estimates,
    prices: TrainingPrices | None,
    record: SpotTrainingRecord,
) -> bool:
    """Whether the next training job (or the standby that holds its node) starts on spot."""
    capacity = spec.training.capacity
    if capacity != TrainingCapacity.AUTO:
        return capacity == TrainingCapacity.SPOT
    if refused_at is not None and now - refused_at < SPOT_RETRY_AFTER_SECONDS:
        return False
    if prices is None:
        return False  # no price to weigh: the spec's safe side
    job = estimates.training_seconds or estimates.startup_seconds
    lost_per_preemption = estimates.startup_seconds + spec.training.checkpoint_every_s / 2
    spot_seconds = job * (1 + record.preemptions_per_second * lost_per_preemption)
    return prices.spot * spot_seconds < prices.on_demand * job


def spot_wait_expired(spec: RunSpec, pod: PodStatus, now: float, estimates: Estimates, rollout_stalled: bool) -> bool:
    """An auto run's spot training (or standby) pod has waited for a node past its patience (and
    never had one), and on-demand would buy time: not while the run's spot rollout workers all wait
    for nodes too (an outage of both, likely of one zone), when the next batch is as late as the job."""
    return (
        spec.training.capacity == TrainingCapacity.AUTO
        and not rollout_stalled
        and pod.capacity_type == "spot"
        and pod.waiting_for_node
        and pod.node_joined_at is None
        and now - pod.started_at > PATIENCE_STARTUPS * estimates.startup_seconds
    )


def spot_loss(pod: PodStatus) -> bool:
    """A training pod that ended by no fault of its own: preempted, or stopped before any node held
    it. Its iteration starts again without counting a failure."""
    return pod.preempted or (pod.waiting_for_node and pod.node_joined_at is None)
