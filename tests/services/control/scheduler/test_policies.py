"""The cost policies' decisions, as the pure ``plan`` gives them (``services.control.scheduler.policies``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from contracts.status import RunStatus
from services.control.scheduler.plan import (
    LaunchStandby,
    LaunchTraining,
    LaunchWorker,
    PublishPrompts,
    RecordReason,
    StopPod,
    plan,
)
from services.control.scheduler.policies import Estimates, measured
from services.control.scheduler.run_state import Observed, RunState, training_ended_at
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodPhase, PodStatus
from services.ports.state.state_store import LedgerEntry

NOW = 10_000.0
# One worker makes 1 sample/s, a job takes 50 s: two workers make a batch of 100 as a job trains it.
MEASURED = Estimates(rollout_samples_per_s=1.0, training_seconds=50.0, startup_seconds=90.0)


def spec(policy: str, **changes) -> RunSpec:
    return RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "1+1", "answer": "2"}],
            "samples_per_prompt": 4,
            "batch_samples": 100,
            "iterations": 5,
            "cost_policy": policy,
            "rollout": {"min_workers": 0, "max_workers": 8, "prompts_per_batch": 25},
            **changes,
        }
    )


def state(policy: str, worker_slots_used: int = 2, **changes) -> RunState:
    return RunState(
        run_id="r",
        status=RunStatus.RUNNING,
        spec=spec(policy, **changes),
        iterations_done=1,
        prompts_published=50,
        worker_slots_used=worker_slots_used,
        samples_produced=200,
        started_at=NOW - 1000,
    )


def pod(name: str, role: str, capacity: str = "spot", **labels: str) -> PodStatus:
    return PodStatus(
        name=name,
        run_id="r",
        role=role,
        instance_type="g6.xlarge",
        capacity_type=capacity,
        labels=labels,
        phase=PodPhase.RUNNING,
        exit_code=None,
        started_at=NOW - 100,
        ended_at=None,
        pid=None,
    )


WORKERS = [pod("r-rollout-0", "rollout", slot="0"), pod("r-rollout-1", "rollout", slot="1")]
JOB = pod("r-train-2", "training", "on-demand", iteration="2")
STANDBY = pod("r-warm-1", "standby", "on-demand", after_iteration="1")


def world(pods, prompts: int, samples: int, estimates: Estimates = MEASURED, produced: int = 200) -> Observed:
    return Observed(
        pods=pods,
        prompt_backlog=prompts,
        sample_backlog=samples,
        samples_produced=produced,
        spent_dollars=0.0,
        billed=frozenset(p.name for p in pods),
        open_entries={p.name: p.started_at for p in pods},
        now=NOW,
        estimates=estimates,
    )


def launched(actions) -> list:
    return [
        a for a in actions if isinstance(a, LaunchWorker | LaunchStandby | LaunchTraining | StopPod | PublishPrompts)
    ]


# Workers at half MEASURED's pace: 64 samples to go at 1/s is a 64 s wait.
SLOW = Estimates(rollout_samples_per_s=0.5, training_seconds=50.0, startup_seconds=90.0)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("cost-aware", [LaunchStandby("r", 1)]),  # a 64 s wait: the node, up in 90 s, is ready as the batch comes
        ("threshold", []),  # the node goes once the job ends
        ("always-on", [LaunchStandby("r", 1)]),
    ],
)
def test_a_batch_due_within_a_restart_keeps_the_training_node_warm(policy: str, expected: list) -> None:
    actions = plan(state(policy), world(WORKERS, prompts=16, samples=36, estimates=SLOW))
    assert [a for a in actions if isinstance(a, LaunchStandby)] == expected


@pytest.mark.parametrize("samples", [60, 0])  # a 20 s wait (below the 60 s billed minimum); a 100 s one (idle)
def test_cost_aware_launches_no_standby_billed_beyond_its_use(samples: int) -> None:
    # A standby for 20 s is billed a minute, and a cold start at the batch pays its start-up once
    # anyway; one up 10 s before the batch bills those seconds idle.
    estimates = MEASURED if samples else SLOW
    actions = plan(state("cost-aware"), world(WORKERS, prompts=25, samples=samples, estimates=estimates))
    assert not any(isinstance(a, LaunchStandby) for a in actions)


def test_cost_aware_lets_the_node_go_when_the_wait_costs_more_than_a_restart() -> None:
    # 100 samples to go at 2/s: 50 s; with a 30 s start-up the restart is cheaper.
    short_start = Estimates(1.0, 50.0, startup_seconds=30.0)
    assert launched(
        plan(state("cost-aware"), world(WORKERS + [STANDBY], prompts=25, samples=0, estimates=short_start))
    ) == [StopPod("r-warm-1")]


def test_the_job_takes_the_warm_nodes_place() -> None:
    actions = launched(plan(state("cost-aware"), world(WORKERS + [STANDBY], prompts=0, samples=100)))
    assert LaunchTraining("r", 2) in actions and StopPod("r-warm-1") in actions
    assert not any(isinstance(a, LaunchStandby) for a in actions)


def test_cost_aware_sizes_the_pool_so_the_next_batch_is_ready_as_the_job_ends() -> None:
    # A job runs and holds its batch; 25 prompts queued, of which 100 / (1/s * 50 s) = 2 workers keep up.
    one = WORKERS[:1]
    actions = launched(plan(state("cost-aware", worker_slots_used=1), world(one + [JOB], prompts=25, samples=100)))
    assert actions == [LaunchWorker("r", 1)]
    slow_trainer = Estimates(1.0, 12.5, 90.0)  # 8 workers to keep up with it: the pool's maximum
    actions = launched(
        plan(
            state("cost-aware", worker_slots_used=1),
            world(one + [JOB], prompts=25, samples=100, estimates=slow_trainer),
        )
    )
    assert [a.slot for a in actions if isinstance(a, LaunchWorker)] == [1, 2, 3, 4, 5, 6, 7]
    # threshold: one worker batch of prompts, one worker
    assert launched(plan(state("threshold", worker_slots_used=1), world(one + [JOB], prompts=25, samples=100))) == []


def test_with_staleness_bound_zero_cost_aware_makes_nothing_while_a_job_runs() -> None:
    # Samples made now come from a policy the running job makes stale: none published, idle workers go.
    actions = launched(plan(state("cost-aware", staleness_bound=0), world(WORKERS + [JOB], prompts=0, samples=100)))
    assert actions == [StopPod("r-rollout-0"), StopPod("r-rollout-1")]
    published = launched(plan(state("threshold", staleness_bound=0), world(WORKERS + [JOB], prompts=0, samples=100)))
    assert published[0] == PublishPrompts("r", 50, 25)


# Spot made 0.2 samples/s over the last 900 s (the deadline rule's window).
SPOT_PROGRESS = ((NOW - 900, 20), (NOW, 200))


@pytest.mark.parametrize(("deadline", "bought"), [(1_000_000.0, 0), (1500.0, 2)])
def test_cost_aware_buys_on_demand_rollout_only_to_meet_the_deadline(deadline: float, bought: int) -> None:
    # 300 samples to make, 500 s left: past the latest safe moment. The trainer takes a batch (100)
    # per 50 s job, 2/s; spot makes 0.2/s, one worker 1/s: two on-demand workers beside the spot
    # pool (a batch per job, not a trickle of one). With a deadline far off, none.
    run = state("cost-aware", worker_slots_used=0, deadline_seconds=deadline)
    observed = replace(world([JOB], prompts=25, samples=100), spot_progress=SPOT_PROGRESS)
    actions = [a for a in plan(run, observed) if isinstance(a, LaunchWorker)]
    assert [a.on_demand for a in actions] == [False, False] + [True] * bought


def test_the_deadline_rules_account_is_shown_on_the_run_when_it_changes_not_each_tick() -> None:
    run = state("cost-aware", worker_slots_used=0, deadline_seconds=1500.0)
    observed = replace(world([JOB], prompts=25, samples=100), spot_progress=SPOT_PROGRESS)
    [shown] = [a for a in plan(run, observed) if isinstance(a, RecordReason)]
    assert shown.reason.startswith("buying 2 on-demand workers: pace 0.20/s from spot")
    # The same account with other figures (the pace a tick later) is not written again.
    moved = shown.reason.replace("0.20/s", "0.21/s")
    assert not [a for a in plan(replace(run, status_reason=moved), observed) if isinstance(a, RecordReason)]
    # With the deadline far off the account changes to waiting; without one, there is none to show.
    relaxed = replace(run, spec=spec("cost-aware", deadline_seconds=1_000_000.0), status_reason=shown.reason)
    [waiting] = [a for a in plan(relaxed, observed) if isinstance(a, RecordReason)]
    assert waiting.reason.startswith("waiting for spot (0.20/s)")
    no_deadline = replace(run, spec=spec("cost-aware"), status_reason=waiting.reason)
    assert [a for a in plan(no_deadline, observed) if isinstance(a, RecordReason)] == [RecordReason("r", None)]


def test_cost_aware_gives_on_demand_workers_back_once_spot_is_on_pace() -> None:
    # As above, with one on-demand worker held; spot now makes 2/s over the window: alone it finishes
    # (300 / 2 + 50 + 90 s) with 25% of the 500 s left to spare, so the worker goes back. At 0.5/s
    # it is kept and joined by one more (the trainer's 2/s).
    run = state("cost-aware", deadline_seconds=1500.0)
    bought = pod("r-rollout-2", "rollout", "on-demand", slot="2")
    fast = replace(world([*WORKERS, bought, JOB], prompts=25, samples=100), spot_progress=((NOW - 900, 0), (NOW, 1800)))
    assert StopPod("r-rollout-2") in plan(run, fast)
    slow = replace(fast, spot_progress=((NOW - 900, 0), (NOW, 450)))
    assert [a for a in plan(run, slow) if isinstance(a, StopPod | LaunchWorker)] == [
        LaunchWorker("r", 2, on_demand=True)
    ]


@pytest.mark.parametrize(("elapsed", "on_demand"), [(200.0, False), (999.0, False), (1000.0, True)])
def test_cost_aware_without_a_sample_waits_a_quarter_of_the_deadline_for_spot(elapsed: float, on_demand: bool) -> None:
    # Nothing produced yet (no spot capacity): no pace to project, so a quarter of the 4000 s deadline.
    run = replace(
        state("cost-aware", worker_slots_used=0, deadline_seconds=4000.0),
        started_at=NOW - elapsed,
        iterations_done=0,
        prompts_published=25,
        samples_produced=0,
    )
    actions = [
        a
        for a in plan(run, world([], prompts=25, samples=0, estimates=Estimates(None, None), produced=0))
        if isinstance(a, LaunchWorker)
    ]
    assert actions and any(a.on_demand for a in actions) is on_demand
    # One on-demand worker measures the rate the deadline rule sizes by; the pool waits for spot.
    assert sum(a.on_demand for a in actions) == on_demand


def test_spot_workers_waiting_for_a_node_keep_waiting_beside_the_on_demand_ones_bought() -> None:
    # The deadline needs two more workers (as above) while the two spot workers wait for capacity:
    # they keep waiting (unbilled until a node comes), the two workers the trainer needs are bought.
    run = state("cost-aware", deadline_seconds=1500.0)
    waiting = [replace(w, waiting_for_node=True) for w in WORKERS]
    observed = replace(world(waiting + [JOB], prompts=25, samples=100), spot_progress=SPOT_PROGRESS)
    assert launched(plan(run, observed)) == [LaunchWorker("r", 2, on_demand=True), LaunchWorker("r", 3, on_demand=True)]
    # With time to spare they keep waiting for spot.
    assert launched(plan(state("cost-aware", deadline_seconds=1_000_000.0), observed)) == []


def test_workers_waiting_for_a_node_make_no_batch_worth_a_warm_node() -> None:
    # As in the first test (a 64 s wait with two workers at 0.5/s), but one of them waits for spot
    # capacity: the batch is 128 s away at the pace of the one working, too far to hold a node for.
    one_waiting = [WORKERS[0], replace(WORKERS[1], waiting_for_node=True)]
    actions = plan(state("cost-aware"), world(one_waiting, prompts=16, samples=36, estimates=SLOW))
    assert not any(isinstance(a, LaunchStandby) for a in actions)


def test_a_smaller_pool_stops_the_workers_waiting_for_a_node_first() -> None:
    # No prompt left to hand out, one worker kept (min_workers): the one at work, not the one waiting.
    run = state("threshold", rollout={"min_workers": 1, "max_workers": 8, "prompts_per_batch": 25})
    waiting_first = [replace(WORKERS[0], waiting_for_node=True), WORKERS[1]]
    actions = launched(plan(run, world(waiting_first, prompts=0, samples=100)))
    assert [a for a in actions if isinstance(a, StopPod)] == [StopPod("r-rollout-0")]


def test_always_on_rollout_is_on_demand() -> None:
    actions = [
        a
        for a in plan(state("always-on", worker_slots_used=0), world([JOB], prompts=25, samples=100))
        if isinstance(a, LaunchWorker)
    ]
    assert actions and all(a.on_demand for a in actions)


def test_estimates_come_from_what_the_workers_and_jobs_measured() -> None:
    assert measured([], []) == Estimates(None, None)
    e = measured([(300, 100.0), (100, 100.0)], [10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    assert e.rollout_samples_per_s == 2.0 and e.training_seconds == 40.0  # the last five jobs


@pytest.mark.parametrize(
    ("policy", "iterations_done", "kept"),
    [
        ("cost-aware", 1, True),  # the next batch's prompts come next tick: a tick idle, not a restart each
        ("cost-aware", 4, False),  # the last batch: nothing more to make
        ("threshold", 1, False),  # the threshold pool follows the backlog, empty for that tick
    ],
)
def test_cost_aware_keeps_the_pool_up_as_the_batch_goes_to_its_job(
    policy: str, iterations_done: int, kept: bool
) -> None:
    run = replace(state(policy), iterations_done=iterations_done)
    actions = plan(run, world(WORKERS, prompts=0, samples=100))
    assert LaunchTraining("r", iterations_done + 1) in actions
    assert any(isinstance(a, StopPod) and "rollout" in a.name for a in actions) is not kept


@pytest.mark.parametrize(
    ("policy", "training_seconds", "iterations_done", "kept"),
    [
        ("cost-aware", 50.0, 1, True),  # the job ends in 40 s, under a worker's 90 s start-up: idle until then
        ("cost-aware", 500.0, 1, False),  # in 490 s: stopping and coming back costs less
        ("cost-aware", 50.0, 3, False),  # the complete batch is the run's last
        ("threshold", 50.0, 1, False),  # the threshold pool follows the backlog, empty now
    ],
)
def test_cost_aware_keeps_a_pool_a_batch_ahead_while_the_job_ends_within_a_start_up(
    policy: str, training_seconds: float, iterations_done: int, kept: bool
) -> None:
    # The job (started 10 s ago) holds its batch, and the next batch is complete: no prompt to publish before it ends.
    job = replace(JOB, started_at=NOW - 10, labels={"iteration": str(iterations_done + 1)})
    estimates = replace(MEASURED, training_seconds=training_seconds)
    actions = plan(
        replace(state(policy), iterations_done=iterations_done),
        world(WORKERS + [job], prompts=0, samples=200, estimates=estimates),
    )
    assert not any(isinstance(a, PublishPrompts | LaunchTraining) for a in actions)
    assert any(isinstance(a, StopPod) and "rollout" in a.name for a in actions) is not kept


# Scarce spot: two workers on nodes make 0.2 samples/s, a batch of 100 in 500 s; a job takes 300 s.
# A complete batch's job is launched once the next batch is due within 90 + 0.9 x 300 = 360 s.
SCARCE = Estimates(rollout_samples_per_s=0.1, training_seconds=300.0, startup_seconds=90.0)


def test_a_complete_batch_waits_for_the_next_to_train_both_back_to_back() -> None:
    waits = plan(state("cost-aware"), world(WORKERS, prompts=0, samples=100, estimates=SCARCE))
    # The next batch (500 s away) is made meanwhile: its prompts now, no job yet.
    assert launched(waits) == [PublishPrompts("r", 50, 25)]
    # 40 samples to go (200 s): launched, to end as the next batch comes.
    assert LaunchTraining("r", 2) in plan(
        state("cost-aware"), world(WORKERS, prompts=10, samples=160, estimates=SCARCE)
    )
    # No pair with a staleness bound of 0 (the second batch's samples would be too old), nor for
    # the run's last batch.
    fresh = plan(state("cost-aware", staleness_bound=0), world(WORKERS, prompts=0, samples=100, estimates=SCARCE))
    assert LaunchTraining("r", 2) in fresh
    last = plan(state("cost-aware", iterations=2), world(WORKERS, prompts=0, samples=100, estimates=SCARCE))
    assert LaunchTraining("r", 2) in last
    # Where the next batch comes within the job, the job starts at once (as it always has).
    assert LaunchTraining("r", 2) in plan(state("cost-aware"), world(WORKERS, prompts=0, samples=100))


def test_a_pairs_first_job_starts_cold_and_its_second_takes_the_node_it_leaves() -> None:
    # 14 samples to go (70 s): a standby would be launched to be up as the batch comes, but the
    # batch will wait for the next one, and its job start cold then.
    assert not any(
        isinstance(a, LaunchStandby)
        for a in plan(state("cost-aware"), world(WORKERS, prompts=4, samples=86, estimates=SCARCE))
    )
    # 10 samples to go (50 s) as the pair's first job has just ended: its node is held for the second.
    just_ended = replace(world(WORKERS, prompts=3, samples=90, estimates=SCARCE), training_ended_at=NOW - 10)
    assert LaunchStandby("r", 1) in plan(state("cost-aware"), just_ended)
    long_ago = replace(just_ended, training_ended_at=NOW - 100)
    assert not any(isinstance(a, LaunchStandby) for a in plan(state("cost-aware"), long_ago))


def test_the_last_training_end_comes_from_the_ledger() -> None:
    def entry(pod: str, role: str, ended_at: float | None) -> LedgerEntry:
        return LedgerEntry(0, "r", role, pod, "p4d.24xlarge", "on-demand", 21.96, "catalog", 100.0, ended_at)

    assert training_ended_at([entry("r-rollout-0", "rollout", 900.0)]) is None
    ledger = [
        entry("r-train-1", "training", 400.0),
        entry("r-warm-1", "standby", 700.0),
        entry("r-train-2", "training", None),  # still running
        entry("r-rollout-0", "rollout", 900.0),
    ]
    assert training_ended_at(ledger) == 700.0
