"""The scheduler's decisions: a pure function from (run, observed world) to actions.

``plan`` never does I/O; ``services.control.scheduler.loop`` gathers its inputs and applies what it
returns, every tick. Because it reads the whole state each time (level-triggered), a restarted
scheduler carries on from the state store and the launcher's pods, and names are deterministic
(``<run>-train-<iteration>``, ``<run>-rollout-<slot>``), so nothing is launched twice.

A run's life, one tick at a time (batch_samples=8, samples_per_prompt=4, iterations=2,
rollout min 1 / max 2, prompts_per_batch=2):

1. PENDING                         -> StartRun (topics created, RUNNING)
2. no backlog                      -> PublishPrompts(2 prompts = 8 samples), LaunchWorker x1
3. prompt backlog 2                -> (pool 1 covers 2 prompts in one batch) nothing new
4. sample backlog 8                -> LaunchTraining(1)
5. training-1 running, backlog 0   -> PublishPrompts(2): the next batch is generated while training runs
6. training-1 Succeeded            -> RecordIteration(1), ReapPod(training-1)
7. sample backlog 8                -> LaunchTraining(2); no more prompts are needed, so the pool goes to 0
8. training-2 Succeeded            -> RecordIteration(2), ReapPod
9. iterations reached              -> BeginEnding(SUCCEEDED) (the run reads ENDING), StopPod for pods still alive
10. no pods alive, samples queued  -> DropLeftovers: counted as dropped, at most a bounded number per tick
11. nothing queued                 -> FinishRun(SUCCEEDED)

A cancel is the state store's doing (the run reads CANCELLING, to end CANCELLED); from then on,
as in ENDING, ``plan`` only stops and reaps pods and finishes the run once none is left.

A training job whose result is published is an iteration, whatever its pod's end: it may have
been killed, or stopped by a cancel, after writing ``result.json`` (and perhaps after committing
its samples). Its policy version exists and its samples were trained, so ``RecordIteration``
(which also commits the samples the job did not get to commit); only a job that ended without
a result failed.

Work per tick is bounded: at most ``MAX_PROMPTS_PER_TICK`` prompts published and
``MAX_LEFTOVERS_PER_TICK`` leftover samples dropped per run; the rest follows on later ticks
(level-triggered, the next tick sees what is still missing), so one run with a huge batch does
not hold the other runs up.

What to spend on is the run's cost policy's (``services.control.scheduler.policies``, the spec's
``cost_policy``): how many rollout workers, on which capacity, whether to publish ahead, and
whether to hold a warm training node. A warm node is a standby pod (``<run>-warm-<N>``, role
``standby``) on the training instance type, on-demand, billed in the ledger like any pod, that
runs nothing but holds the machine (``python -m services.control.scheduler.standby``); when the next
batch is ready, ``LaunchTraining`` and ``StopPod(standby)`` come in the same tick, and the job
lands on the node the standby held (on Kubernetes: the same node pool, the node still up; the
embedded launcher pays no start-up in any case). So keeping a node warm costs its idle seconds,
and a cold start its start-up: the policy weighs the two (ski rental). ``spotrl simulate``
(``services.control.simulate``) calls this same ``plan`` against a simulated world.

Held-out evals (eval pods ``<run>-eval-<N>`` of chosen policy versions, beside rollout and training,
and what a run's end does with them) are ``services.control.scheduler.evals``'s.

The ledger is matched to the pods first, every tick (``services.control.scheduler.ledger_match``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contracts.status import RunStatus
from services.control.scheduler.evals import (
    LaunchEval,
    RecordEval,
    RecordEvalFailure,
    evals_at_end,
    evals_due,
    reap_eval,
)
from services.control.scheduler.ledger_match import BillPod, CloseEntry, DeferEntry, match_ledger
from services.control.scheduler.policies import POLICIES, Decision, PolicyInput
from services.control.scheduler.pool_options import Placement, option_of, place_spot
from services.control.scheduler.reward_server import LaunchRewardServer, reward_server_due, serving_evals
from services.control.scheduler.run_state import Observed, RunState, retry_delay
from services.control.scheduler.spot_training import (
    PATIENCE_STARTUPS,
    give_up_zone,
    spot_loss,
    spot_wait_expired,
    spot_zone,
    spot_zones,
)
from services.domain.names import ROLE_EVAL, ROLE_ROLLOUT, ROLE_STANDBY, ROLE_TRAINING
from services.domain.run_end import run_end
from services.ports.launcher.launcher import PodPhase, PodStatus

# Prompts one tick publishes per run (~20 ms of embedded-queue writes on 2 CPU cores, measured);
# a run that needs more (batch_samples / samples_per_prompt beyond this) gets them over several
# ticks: at 0.5 s a tick still ~8000 prompts a second, far more than rollout workers take.
MAX_PROMPTS_PER_TICK = 4096
# Leftover samples one tick reads and counts as dropped per run, once its pods are gone.
MAX_LEFTOVERS_PER_TICK = 4096


# --- actions --------------------------------------------------------------------------
@dataclass(frozen=True)
class StartRun:
    run_id: str


@dataclass(frozen=True)
class PublishPrompts:
    run_id: str
    start: int  # index into the run's prompt set, cycling over epochs
    count: int


@dataclass(frozen=True)
class LaunchWorker:
    run_id: str
    slot: int
    on_demand: bool = False  # on on-demand capacity whatever the pool's ``spot`` (the policy's deadline fallback)
    option: int = 0  # where, among ``rollout.choices`` (an on-demand worker: 0, ``instance_type``)


@dataclass(frozen=True)
class LaunchTraining:
    run_id: str
    iteration: int
    spot: bool = False  # on spot capacity (``services.control.scheduler.spot_training``)
    zone: int = 0  # a spot job's zone, among ``spot_zones(spec)``


@dataclass(frozen=True)
class LaunchStandby:
    """Hold a warm training node (a standby pod) after ``after_iteration``; the next job replaces it."""

    run_id: str
    after_iteration: int
    spot: bool = False  # on the capacity the next job will take
    zone: int = 0  # a spot standby's zone, among ``spot_zones(spec)``


@dataclass(frozen=True)
class RefuseSpotTraining:
    """No spot training node came in time in a zone: the run's spot zones given up, each with when
    (``RunState.spot_training_refusals`` as it becomes)."""

    run_id: str
    refusals: Mapping[str, float]


@dataclass(frozen=True)
class StopPod:
    name: str


@dataclass(frozen=True)
class ReapPod:
    """Close the pod's ledger entry at its end time and forget it."""

    pod: PodStatus


@dataclass(frozen=True)
class RecordIteration:
    run_id: str
    iteration: int


@dataclass(frozen=True)
class RecordTrainingFailure:
    run_id: str
    iteration: int
    failures: int
    retry_at: float


@dataclass(frozen=True)
class RecordProgress:
    run_id: str
    samples_produced: int


@dataclass(frozen=True)
class RecordReason:
    """Show ``reason`` with the running run's status: why its rollout capacity is what it is (the
    deadline rule's account), or nothing."""

    run_id: str
    reason: str | None


@dataclass(frozen=True)
class BeginEnding:
    run_id: str
    status: RunStatus
    reason: str


@dataclass(frozen=True)
class DropLeftovers:
    """All pods are gone: count the samples of up to ``limit`` of the groups still queued as
    dropped (nobody will train them), committing them."""

    run_id: str
    limit: int


@dataclass(frozen=True)
class FinishRun:
    """All pods are gone and nothing is queued: set the terminal status."""

    run_id: str
    status: RunStatus
    reason: str


Action = (
    StartRun
    | PublishPrompts
    | LaunchWorker
    | LaunchTraining
    | LaunchStandby
    | RefuseSpotTraining
    | LaunchEval
    | LaunchRewardServer
    | StopPod
    | BillPod
    | DeferEntry
    | CloseEntry
    | ReapPod
    | RecordIteration
    | RecordTrainingFailure
    | RecordEval
    | RecordEvalFailure
    | RecordProgress
    | RecordReason
    | BeginEnding
    | DropLeftovers
    | FinishRun
)


def plan(run: RunState, observed: Observed) -> list[Action]:
    """Decide this tick's actions for one run: the ledger matched to the pods, then its life's next step."""
    return match_ledger(observed) + _next_step(run, observed)


def _next_step(run: RunState, observed: Observed) -> list[Action]:
    alive = [p for p in observed.pods if p.phase == PodPhase.RUNNING]
    done = [p for p in observed.pods if p.phase != PodPhase.RUNNING]

    if run.status.is_terminal():
        # Only after a crash between FinishRun and the pods' end: clean up, never start anything.
        return [StopPod(p.name) for p in alive] + [ReapPod(p) for p in done]

    if run.status == RunStatus.PENDING:
        return [StartRun(run.run_id)]

    actions: list[Action] = []
    if observed.samples_produced != run.samples_produced:
        actions.append(RecordProgress(run.run_id, observed.samples_produced))

    # Finished pods first; the next tick decides with their results recorded.
    if done:
        return actions + _reap(run, done, observed)

    ending = _end_condition(run, observed)
    if ending is not None:
        status, reason = ending
        if not run.status.is_stopping():
            actions.append(BeginEnding(run.run_id, status, reason))
        # A run that succeeded lets its evals on a node finish, and evaluates its last version; any other end stops them.
        kept, evals = evals_at_end(run, observed, alive, succeeded=status == RunStatus.SUCCEEDED)
        keep = [*kept, *serving_evals(alive, kept)]
        stopped = [p for p in alive if p not in keep]
        if stopped:
            return actions + [StopPod(p.name) for p in stopped] + evals
        if observed.sample_backlog > 0:
            groups = max(1, MAX_LEFTOVERS_PER_TICK // run.spec.samples_per_prompt)
            return actions + [DropLeftovers(run.run_id, groups)] + evals
        if kept or evals or (status == RunStatus.SUCCEEDED and run.evals_open):  # evals run, start, or await a retry
            return actions + evals
        return actions + [FinishRun(run.run_id, status, reason)]

    # Training's decisions first; the evals ride beside them.
    return (
        actions
        + _feed_and_scale(run, observed, alive)
        + evals_due(run, observed, final=False)
        + reward_server_due(run, alive)
    )


def _reap(run: RunState, done: Sequence[PodStatus], observed: Observed) -> list[Action]:
    actions: list[Action] = []
    for pod in done:
        if pod.role == ROLE_TRAINING:
            iteration = int(pod.labels["iteration"])
            # Published is trained, however the pod ended (killed or stopped after writing its result).
            if pod.phase == PodPhase.SUCCEEDED or iteration in observed.published:
                actions.append(RecordIteration(run.run_id, iteration))
            elif spot_loss(pod):
                pass  # preempted, or given up before a node came: started again, no failure counted
            elif iteration > run.iterations_done and not run.status.is_stopping():  # not one we stopped
                failures = run.train_failures + 1
                if failures > run.spec.training.max_retries:
                    actions.append(
                        BeginEnding(
                            run.run_id,
                            RunStatus.FAILED,
                            f"training job for iteration {iteration} failed {failures} times "
                            f"(last exit code {pod.exit_code}); see `spotrl logs {pod.name}`",
                        )
                    )
                else:
                    actions.append(
                        RecordTrainingFailure(run.run_id, iteration, failures, observed.now + retry_delay(failures))
                    )
        elif pod.role == ROLE_EVAL:
            actions += reap_eval(run, pod, observed)
        actions.append(ReapPod(pod))
    return actions


def _end_condition(run: RunState, observed: Observed) -> tuple[RunStatus, str] | None:
    """The end the run is stopping with (a cancel, or one begun on an earlier tick), else the end it has reached."""
    if run.status.is_stopping() and run.ending_status is not None:
        return run.ending_status, run.ending_reason or ""
    end = run_end(
        run.spec,
        iterations_done=run.iterations_done,
        last_mean_reward=run.last_mean_reward,
        spent_dollars=observed.spent_dollars,
        best_eval=run.best_eval,
    )
    return None if end is None else (end.status, end.reason)


def _feed_and_scale(run: RunState, observed: Observed, alive: Sequence[PodStatus]) -> list[Action]:
    spec = run.spec
    n = spec.samples_per_prompt
    batch = spec.batch_samples
    actions: list[Action] = []
    training = [p for p in alive if p.role == ROLE_TRAINING]
    standby = [p for p in alive if p.role == ROLE_STANDBY]
    workers = sorted((p for p in alive if p.role == ROLE_ROLLOUT), key=lambda p: int(p.labels["slot"]))

    # Samples on their way into the next batch. A running job takes exactly one batch (in
    # whole groups) and holds it in the backlog until it commits.
    holding = bool(training) and observed.trainer_committed == run.train_launch_committed
    queued_for_next = max(0, observed.sample_backlog - (batch if holding else 0))
    coming = queued_for_next + observed.prompt_backlog * n
    # Keep one batch ahead of the trainer, never more than the remaining iterations need.
    still_needed: int | None = None  # samples the remaining iterations need; None = until the target reward
    if spec.iterations is not None:
        still_needed = max(0, spec.iterations - run.iterations_done - len(training)) * batch

    def to_publish_for(batches: int) -> int:
        """Prompts to publish now to keep ``batches`` ahead of the trainer (the rest on later ticks)."""
        want = batch * batches if still_needed is None else min(batch * batches, still_needed)
        return min(MAX_PROMPTS_PER_TICK, math.ceil((want - coming) / n)) if want > coming else 0

    to_publish = to_publish_for(1)

    decision = POLICIES[spec.cost_policy](
        PolicyInput(
            spec=spec,
            now=observed.now,
            started_at=run.started_at,
            training_running=bool(training),
            training_started_at=min((p.started_at for p in training), default=None),
            training_ended_at=observed.training_ended_at,
            standby=bool(standby),
            workers=len(workers),
            workers_on_node=sum(not p.waiting_for_node for p in workers),
            prompt_backlog=observed.prompt_backlog,
            to_publish=to_publish,
            queued_for_next=queued_for_next,
            still_needed=still_needed,
            samples_produced=observed.samples_produced,
            estimates=observed.estimates,
            on_demand_workers=sum(p.capacity_type != "spot" for p in workers) if spec.rollout.spot else 0,
            spot_progress=observed.spot_progress,
        )
    )
    if run.status == RunStatus.RUNNING and _account(decision.reason) != _account(run.status_reason):
        actions.append(RecordReason(run.run_id, decision.reason))
    if decision.pair:  # the complete batch waits for the next: its prompts now
        to_publish = to_publish_for(2)
    if to_publish and decision.publish:
        actions.append(PublishPrompts(run.run_id, run.prompts_published, to_publish))
    if decision.on_demand_workers is not None and spec.rollout.spot:
        # A spot pool and on-demand workers beside it, each sized on its own.
        spot = [p for p in workers if p.capacity_type == "spot"]
        bought = [p for p in workers if p.capacity_type != "spot"]
        return (
            actions
            + _scale(run, observed, spot, decision.workers, bought, decision.on_demand_workers)
            + _train(run, observed, training, standby, decision, workers)
        )
    actions += _scale(run, observed, workers, decision.workers, [], 0, on_demand=decision.on_demand)
    return actions + _train(run, observed, training, standby, decision, workers)


def _account(reason: str | None) -> str | None:
    """A policy's reason without its figures: the run shows a new reason when its account changes
    (waiting, buying, keeping, giving back), not each tick its measured pace moves."""
    return None if reason is None else re.sub(r"[0-9][0-9.]*", "#", reason)


def _scale(
    run: RunState,
    observed: Observed,
    pool: Sequence[PodStatus],
    size: int,
    bought: Sequence[PodStatus],
    bought_size: int,
    on_demand: bool = False,
) -> list[Action]:
    """Launch or stop workers to hold ``size`` in ``pool`` (new ones on-demand if ``on_demand``, else
    on the pool option ``pool_options`` picks) and ``bought_size`` on-demand ones in ``bought``, new
    workers in fresh slots."""
    actions: list[Action] = []
    slot = run.worker_slots_used
    if run.spec.rollout.spot and not on_demand:
        prices = observed.option_prices or (0.0,) * len(run.spec.rollout.choices)
        patience = PATIENCE_STARTUPS * observed.estimates.startup_seconds
        placed = place_spot(prices, pool, size, observed.now, patience)
    else:  # on-demand workers: instance_type, launched up to the size; a smaller pool stops those waiting first
        placed = Placement(size - len(pool), 0, sorted(pool, key=lambda p: p.waiting_for_node)[size:])
    for _ in range(placed.launch):
        actions.append(LaunchWorker(run.run_id, slot, on_demand=on_demand, option=placed.option))
        slot += 1
    for _ in range(bought_size - len(bought)):
        actions.append(LaunchWorker(run.run_id, slot, on_demand=True))
        slot += 1
    actions += [StopPod(pod.name) for pod in placed.stop]
    # On-demand workers go back newest first: the ones that have made least of their group.
    for pod in sorted(bought, key=lambda p: p.started_at)[max(0, bought_size) :]:
        actions.append(StopPod(pod.name))
    return actions


def _train(
    run: RunState,
    observed: Observed,
    training: Sequence[PodStatus],
    standby: Sequence[PodStatus],
    decision: Decision,
    workers: Sequence[PodStatus],
) -> list[Action]:
    """The next job when its batch waits (taking the warm node's place: the standby pod goes as the
    job starts), on the capacity ``training.capacity`` picks, else the warm node held or let go as
    the policy wants; a spot job or standby that waited too long for a node is stopped, to start in
    another zone or on-demand."""
    spot_workers = [w for w in workers if w.capacity_type == "spot"]
    stalled = bool(spot_workers) and all(w.waiting_for_node for w in spot_workers)
    zones, refusals = spot_zones(run.spec), run.spot_training_refusals
    expired = [
        p
        for p in [*training, *standby]
        if spot_wait_expired(p, observed.now, observed.estimates)
        and give_up_zone(run.spec, option_of(p), refusals, observed.now, stalled)
    ]
    if expired:
        given_up = {zones[option_of(p)]: observed.now for p in expired}
        return [StopPod(p.name) for p in expired] + [RefuseSpotTraining(run.run_id, {**refusals, **given_up})]
    zone = spot_zone(
        run.spec,
        observed.now,
        refusals,
        observed.estimates,
        observed.training_prices,
        observed.spot_training,
    )
    spot, zone = zone is not None, zone or 0
    ready = not training and observed.sample_backlog >= run.spec.batch_samples and observed.now >= run.next_train_at
    if ready and not decision.pair:
        return [LaunchTraining(run.run_id, run.iterations_done + 1, spot, zone)] + [StopPod(p.name) for p in standby]
    if decision.standby and not standby:
        return [LaunchStandby(run.run_id, run.iterations_done, spot, zone)]
    return [] if decision.standby else [StopPod(p.name) for p in standby]
