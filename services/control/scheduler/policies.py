"""Cost policies, registered by name in ``POLICIES``: the run spec's ``cost_policy`` picks one.

``plan`` (``services.control.scheduler.plan``) asks the run's policy three things every tick, and does
the rest (prompts, training launches, the run's end) the same for every policy:

- how many rollout workers to hold, and on which capacity new ones start (spot, or on-demand);
- whether to publish the next batch's prompts now;
- whether to hold a warm training node (a standby pod, see plan's docstring) while no job runs;
- whether a complete batch waits for the next one, to train both back to back on one node.

Policies are pure functions of a ``PolicyInput``; the same ones decide for the real scheduler
and for ``spotrl simulate`` (``services.control.simulate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from services.control.cost.billing import HANDOVER_SECONDS
from services.control.scheduler.deadline import DeadlineCall, DeadlineView, deadline_call
from services.domain.runspec import CostPolicy, RunSpec

# Node start plus model load of a pod, when the run has no better figure (60-90 s, the seed design's figure).
DEFAULT_STARTUP_SECONDS = 90.0
# The least a provider bills a launch (AWS's, GCP's and Alibaba's 60 s: services.control.cost.billing).
MIN_BILLED_SECONDS = 60.0
# A waiting batch's job is launched once the next batch is due within a start-up and this share of
# a job (``_pair``).
PAIR_TRAINING_SHARE = 0.9


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
    workers: int  # rollout workers alive (on-demand ones among them)
    workers_on_node: int  # of them, those a node has taken (the others wait for capacity and make nothing)
    prompt_backlog: int  # prompts published and not yet turned into samples
    to_publish: int  # prompts plan would publish now to keep one batch ahead
    queued_for_next: int  # samples queued for the next batch (not held by a running job)
    still_needed: int | None  # samples the remaining iterations need (None: until the target reward)
    samples_produced: int
    estimates: Estimates
    on_demand_workers: int = 0  # of ``workers``, those on on-demand capacity in a spot pool
    spot_progress: Sequence[tuple[float, int]] = ()  # (time, samples spot workers made so far), recent, oldest first
    training_ended_at: float | None = None  # when the last training or standby pod ended (None: none has)


@dataclass(frozen=True)
class Decision:
    workers: int  # the pool (its spot part when ``on_demand_workers`` is given)
    publish: bool = True  # publish ``to_publish`` prompts now
    on_demand: bool = False  # new rollout workers start on on-demand capacity
    standby: bool = False  # hold a warm training node while no training job runs
    on_demand_workers: int | None = None  # on-demand rollout workers beside a spot pool of ``workers`` (None: no split)
    reason: str | None = None  # why the rollout capacity is what it is (the deadline rule's account)
    # The complete batch waits for the next one (whose prompts plan publishes now), so that both
    # train back to back on one node: the second job takes the first's warm node.
    pair: bool = False


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
    - back to back (a staleness bound of 1 or more): where the next batch would come so long
      after the job that it trains on a cold node, the complete batch waits for it (``_pair``);
    - deadline: on-demand rollout workers beside the spot pool, as many as close the gap
      between spot's recent pace and the pace the deadline needs, given back once spot is back
      on pace; none when training alone would miss it (``services.control.scheduler.deadline``).
    """
    spot = replace(_cost_aware_pool(replace(x, workers=x.workers - x.on_demand_workers)), pair=_pair(x))
    call = _deadline(x, spot.workers)
    if call is None:
        return spot
    # The on-demand workers stay while the spot pool would: between batches too.
    more = spot.workers > 0 or x.prompt_backlog > 0 or _batch_handed_over(x) or _prompts_come_within_startup(x)
    bought = call.on_demand_workers if more else 0
    # A run that buys time does not wait for a second batch.
    return replace(spot, on_demand_workers=bought, reason=call.reason, pair=spot.pair and not bought)


def _deadline(x: PolicyInput, pool_workers: int) -> DeadlineCall | None:
    """The deadline rule's call, for a run with a deadline, a known end and a spot pool."""
    spec, e = x.spec, x.estimates
    if spec.deadline_seconds is None or x.started_at is None or x.still_needed is None or not spec.rollout.spot:
        return None
    return deadline_call(
        DeadlineView(
            deadline_seconds=spec.deadline_seconds,
            started_at=x.started_at,
            now=x.now,
            batch_samples=spec.batch_samples,
            still_needed=x.still_needed,
            queued_for_next=x.queued_for_next,
            spot_progress=x.spot_progress,
            worker_samples_per_s=e.rollout_samples_per_s,
            training_seconds=e.training_seconds,
            training_running_for=None if x.training_started_at is None else x.now - x.training_started_at,
            startup_seconds=e.startup_seconds,
            on_demand_workers=x.on_demand_workers,
            max_workers=spec.rollout.max_workers,
            pool_workers=pool_workers,
        )
    )


def _cost_aware_pool(x: PolicyInput) -> Decision:
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
    return Decision(workers=workers, publish=publish, standby=_keep_warm(x))


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


def _pair(x: PolicyInput) -> bool:
    """Whether the complete batch waits for the next, to train both back to back on one node.

    Launched now, the job ends a start-up and a job's time from now; the next batch comes when the
    workers on nodes have made it. Where that is more than a start-up after the job's end (a node
    held that long costs more than a restart: ``_keep_warm``), the next job would start cold, and
    the run pays a start-up per batch. Waiting instead until the next batch is due as the job ends
    costs nothing the run would not pay: the workers make the next batch meanwhile (its samples one
    version old when trained, within the staleness bound), and the job after the pair waits for
    its batch either way. So the batch waits while the next is due later than a start-up and
    ``PAIR_TRAINING_SHARE`` of a job from now (less than the whole job: a late batch loses the
    pair's saving, an early one idles the workers a while). Not for the run's last batch, nor
    while the deadline rule buys on-demand rollout (``cost_aware``).
    """
    if x.training_running or x.standby or x.queued_for_next < x.spec.batch_samples:
        return False
    return _next_batch_late(x, 2 * x.spec.batch_samples - x.queued_for_next)


def _next_batch_late(x: PolicyInput, samples: int) -> bool:
    """Whether the next batch, ``samples`` from complete at the pace of the workers on nodes, is
    due later than a start-up and ``PAIR_TRAINING_SHARE`` of a job from now, in a run that may pair
    batches (a bound of 1 or more, two batches still to go, the pace and job time measured). With
    the whole batch to make (``samples`` = ``batch_samples``): whether the batch being made will
    wait for the next when complete, its job starting cold then."""
    spec, e = x.spec, x.estimates
    if spec.staleness_bound < 1 or not e.training_seconds:
        return False
    if x.still_needed is not None and x.still_needed < 2 * spec.batch_samples:
        return False
    pace = (e.rollout_samples_per_s or 0.0) * x.workers_on_node
    return pace > 0 and samples / pace > e.startup_seconds + PAIR_TRAINING_SHARE * e.training_seconds


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
    # Where batches are paired, a node a job has just left (still up) is held as one held is: the
    # second job of a pair whose batch is a little late takes it so; and no node is launched for
    # a batch that will wait for the next (its job starts cold then).
    startup = x.estimates.startup_seconds
    paired = _next_batch_late(x, x.spec.batch_samples)
    just_left = x.training_ended_at is not None and x.now - x.training_ended_at <= HANDOVER_SECONDS
    if x.standby or (just_left and paired):
        return wait <= startup
    if paired:
        return False
    return MIN_BILLED_SECONDS <= wait <= MIN_BILLED_SECONDS + max(0.0, startup - MIN_BILLED_SECONDS) / 4


POLICIES: dict[CostPolicy, Policy] = {
    CostPolicy.ALWAYS_ON: always_on,
    CostPolicy.THRESHOLD: threshold,
    CostPolicy.COST_AWARE: cost_aware,
}


# The jobs whose seconds estimate the next one's: the last few (a job's time changes little between batches).
JOB_SECONDS_WINDOW = 5


def measured(
    generated: list[tuple[int, float]], job_seconds: list[float], startup_seconds: float = DEFAULT_STARTUP_SECONDS
) -> Estimates:
    """The run's estimates from its workers' (samples, generation seconds) and its jobs' seconds
    (the last JOB_SECONDS_WINDOW of them, in order; earlier ones are ignored)."""
    samples = sum(s for s, _ in generated)
    seconds = sum(t for _, t in generated)
    recent = job_seconds[-JOB_SECONDS_WINDOW:]
    return Estimates(
        rollout_samples_per_s=samples / seconds if samples and seconds > 0 else None,
        training_seconds=sum(recent) / len(recent) if recent else None,
        startup_seconds=startup_seconds,
    )
