"""Cost policies, registered by name in ``POLICIES``: the run spec's ``cost_policy`` picks one.

``plan`` (``services.control.scheduler.plan``) asks the run's policy three things every tick, and does
the rest (prompts, training launches, the run's end) the same for every policy:

- how many rollout workers to hold, and on which capacity new ones start (spot, or on-demand);
- whether to publish the next batch's prompts now;
- whether to hold a warm training node (a standby pod, see plan's docstring) while no job runs.

Policies are pure functions of a ``PolicyInput``; the same ones decide for the real scheduler
and for ``spotrl simulate`` (``services.control.simulate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.domain.runspec import CostPolicy, RunSpec

# Node start plus model load of a pod, when the run has no better figure (60-90 s, the seed design's figure).
DEFAULT_STARTUP_SECONDS = 90.0
# The least a provider bills a launch (AWS's, GCP's and Alibaba's 60 s: services.control.cost.billing).
MIN_BILLED_SECONDS = 60.0
# The share of a run's deadline it waits for its first sample on spot capacity before new rollout
# workers go on-demand (without a sample there is no pace to project the run's end from).
UNMEASURED_DEADLINE_SHARE = 0.25


@dataclass(frozen=True)
class Estimates:
    """What the run has measured so far; None until there is something to measure."""

    rollout_samples_per_s: float | None  # one worker's, while generating
    training_seconds: float | None  # one training job's, per batch
    startup_seconds: float = DEFAULT_STARTUP_SECONDS


@dataclass(frozen=True)
class PolicyInput:
    spec: RunSpec
    now: float
    started_at: float | None  # when the run started (for its deadline)
    training_running: bool
    training_started_at: float | None  # when the running job's pod started (None: no job)
    standby: bool  # a standby pod holds the training node
    workers: int  # rollout workers alive
    workers_on_node: int  # of them, those a node has taken (the others wait for capacity and make nothing)
    prompt_backlog: int  # prompts published and not yet turned into samples
    to_publish: int  # prompts plan would publish now to keep one batch ahead
    queued_for_next: int  # samples queued for the next batch (not held by a running job)
    still_needed: int | None  # samples the remaining iterations need (None: until the target reward)
    samples_produced: int
    estimates: Estimates


@dataclass(frozen=True)
class Decision:
    workers: int
    publish: bool = True  # publish ``to_publish`` prompts now
    on_demand: bool = False  # new rollout workers start on on-demand capacity
    standby: bool = False  # hold a warm training node while no training job runs


Policy = Callable[[PolicyInput], Decision]


def _demand_pool(x: PolicyInput, backlog: int, floor: int = 0) -> int:
    """The threshold pool: the prompt backlog in worker batches, within the spec's bounds; none
    once nothing more is needed; never down while prompts are in workers' hands (a batch in
    progress would be thrown away)."""
    pool = x.spec.rollout
    desired = max(pool.min_workers, min(pool.max_workers, max(floor, math.ceil(backlog / pool.prompts_per_batch))))
    if x.still_needed is not None and backlog == 0 and x.queued_for_next >= x.still_needed:
        desired = 0
    if backlog > 0:
        desired = max(desired, x.workers)
    return desired


def threshold(x: PolicyInput) -> Decision:
    """Launch training at ``batch_samples``, shut it down after; the pool follows the backlog."""
    return Decision(workers=_demand_pool(x, x.prompt_backlog + x.to_publish))


def always_on(x: PolicyInput) -> Decision:
    """On-demand everything, up from start to end: the pool never shrinks, the training node is
    held between jobs."""
    more = x.still_needed is None or x.still_needed > 0
    return Decision(
        workers=max(_demand_pool(x, x.prompt_backlog + x.to_publish), x.workers),
        on_demand=True,
        standby=more and not x.training_running,
    )


def cost_aware(x: PolicyInput) -> Decision:
    """Spend only on work that gets trained, as soon as it can be:

    - pool: sized so the next batch is ready as the running job ends (batch / (rate x training
      seconds) workers), once both are measured and if ``max_workers`` allows it; the design
      card's pool otherwise; kept up for the tick the batch goes to its job (the next batch's
      prompts come the tick after: stopping would cost every worker a start-up), and while the
      next batch is complete and the running job ends within a worker's start-up (ski rental
      again: idling until its prompts come costs less than coming back);
    - staleness: with a bound of 0, samples generated while a job runs would be dropped (they
      come from a policy one version old), so nothing is generated then;
    - warm node (ski rental): hold the training node while the expected wait for the next batch
      (at the pace of the workers a node has taken: those waiting for one make nothing yet)
      is at most a restart's start-up (holding costs the wait, a restart costs the start-up); a
      new one is launched shortly before the batch is ready (never for less than the provider's
      billed minimum), so the job starts (almost) at once;
    - deadline: new workers go on-demand only when, at the run's pace so far, the samples still
      to make would miss ``deadline_seconds``, or when a quarter of it has gone by without a
      single sample (``UNMEASURED_DEADLINE_SHARE``: a zone without spot capacity).
    """
    spec, e = x.spec, x.estimates
    publish = not (spec.staleness_bound == 0 and x.training_running)
    backlog = x.prompt_backlog + (x.to_publish if publish else 0)
    sized = 0
    if e.rollout_samples_per_s and e.training_seconds:
        sized = math.ceil(spec.batch_samples / (e.rollout_samples_per_s * e.training_seconds))
        if sized > spec.rollout.max_workers:
            sized = 0  # no pool allowed keeps up with the trainer: more workers would only add start-ups
    workers = 0 if backlog == 0 and not publish else _demand_pool(x, backlog, floor=sized if backlog else 0)
    if _batch_handed_over(x) or _prompts_come_within_startup(x):
        workers = max(workers, x.workers)
    return Decision(workers=workers, publish=publish, on_demand=_deadline_at_risk(x), standby=_keep_warm(x))


def _batch_handed_over(x: PolicyInput) -> bool:
    """The batch is complete and its job starts this tick, and more batches follow: the next one's
    prompts are published next tick, so the pool stays up (idle for a tick, where stopping it would
    cost each worker a start-up)."""
    queued = x.queued_for_next
    return (
        not x.training_running
        and queued >= x.spec.batch_samples
        and (x.still_needed is None or x.still_needed > queued)
    )


def _prompts_come_within_startup(x: PolicyInput) -> bool:
    """The next batch is complete while a job trains, and more batches follow: its prompts come as
    the job ends (plan publishes them when the batch is handed over), and by the measured job time
    that is at most a worker's start-up away. A pool stopped now would pay every worker's start-up
    to come back, and make the batch after late for its job (the trainer then waits)."""
    e = x.estimates
    if x.training_started_at is None or not e.training_seconds or x.queued_for_next < x.spec.batch_samples:
        return False
    if x.still_needed is not None and x.still_needed <= x.queued_for_next:
        return False  # the complete batch is the last one the run needs
    return x.training_started_at + e.training_seconds - x.now <= e.startup_seconds


def _keep_warm(x: PolicyInput) -> bool:
    r, workers = x.estimates.rollout_samples_per_s, x.workers_on_node
    if x.training_running or x.still_needed == 0 or not r or workers == 0:
        return False
    # Workers without a prompt make nothing: the batch's tail goes at the pace of the prompts left.
    busy = min(workers, max(1, x.prompt_backlog))
    wait = max(0, x.spec.batch_samples - x.queued_for_next) / (r * busy)
    # A node held stays while the wait costs less than a restart. A new one is launched to be up
    # as the batch comes (its start-up is billed either way), erring late: a node up early bills
    # its idle seconds, one up late only delays the job; but never for less than the provider's
    # minimum, which a cold start at the batch would not pay twice. Late, on the bench's traces,
    # is a quarter of the way from that minimum to a start-up (halfway left more idle nodes).
    startup = x.estimates.startup_seconds
    if x.standby:
        return wait <= startup
    return MIN_BILLED_SECONDS <= wait <= MIN_BILLED_SECONDS + max(0.0, startup - MIN_BILLED_SECONDS) / 4


def _deadline_at_risk(x: PolicyInput) -> bool:
    """At the run's pace so far, the samples still to make would miss ``deadline_seconds``. Before
    any sample, there is no pace: the deadline is at risk once ``UNMEASURED_DEADLINE_SHARE`` of it
    has gone by without one (no spot capacity came), and not before."""
    deadline, e = x.spec.deadline_seconds, x.estimates
    if deadline is None or x.started_at is None or x.still_needed is None:
        return False
    elapsed = x.now - x.started_at
    if x.samples_produced == 0:
        return elapsed >= max(e.startup_seconds, UNMEASURED_DEADLINE_SHARE * deadline)
    if elapsed < e.startup_seconds:
        return False  # no pace measured yet
    pace = x.samples_produced / elapsed
    to_make = max(0, x.still_needed - x.queued_for_next)
    finish = elapsed + to_make / pace + (e.training_seconds or 0.0)
    return finish > deadline


POLICIES: dict[CostPolicy, Policy] = {
    CostPolicy.ALWAYS_ON: always_on,
    CostPolicy.THRESHOLD: threshold,
    CostPolicy.COST_AWARE: cost_aware,
}


def measured(
    generated: list[tuple[int, float]], job_seconds: list[float], startup_seconds: float = DEFAULT_STARTUP_SECONDS
) -> Estimates:
    """The run's estimates from its workers' (samples, generation seconds) and its jobs' seconds
    (the last few: a job's time changes little between batches)."""
    samples = sum(s for s, _ in generated)
    seconds = sum(t for _, t in generated)
    recent = job_seconds[-5:]
    return Estimates(
        rollout_samples_per_s=samples / seconds if samples and seconds > 0 else None,
        training_seconds=sum(recent) / len(recent) if recent else None,
        startup_seconds=startup_seconds,
    )
