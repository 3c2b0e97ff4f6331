"""Table tests of the scheduler's pure ``plan``: one row per situation, the actions it must give."""

from __future__ import annotations

import dataclasses

import pytest

from contracts.status import RunStatus
from services.control.cost.billing import NODE_BOOT_SECONDS
from services.control.scheduler.ledger_match import DEFER_STEP_SECONDS, match_ledger
from services.control.scheduler.plan import (
    MAX_LEFTOVERS_PER_TICK,
    MAX_PROMPTS_PER_TICK,
    BeginEnding,
    BillPod,
    CloseEntry,
    DeferEntry,
    DropLeftovers,
    FinishRun,
    LaunchTraining,
    LaunchWorker,
    PublishPrompts,
    ReapPod,
    RecordIteration,
    RecordProgress,
    RecordTrainingFailure,
    StartRun,
    StopPod,
    plan,
)
from services.control.scheduler.run_state import Observed, RunState, retry_delay
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodPhase, PodStatus
from services.ports.state.state_schema import RunRow

NOW = 1000.0
SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": "1+1", "answer": "2"}],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 2,
        "rollout": {"min_workers": 1, "max_workers": 3, "prompts_per_batch": 2},
        "training": {"max_retries": 1},
        "budget_dollars": 5.0,
    }
)


def run(**changes) -> RunState:
    return RunState(**{"run_id": "r", "status": RunStatus.RUNNING, "spec": SPEC, **changes})


def pod(
    name: str, role: str, phase: PodPhase = PodPhase.RUNNING, exit_code: int | None = None, **labels: str
) -> PodStatus:
    return PodStatus(
        name=name,
        run_id="r",
        role=role,
        instance_type="g6.xlarge",
        capacity_type="spot",
        labels=labels,
        phase=phase,
        exit_code=exit_code,
        started_at=NOW - 10,
        ended_at=None if phase == PodPhase.RUNNING else NOW - 1,
        pid=None,
    )


def seen(pods=(), prompts=0, samples=0, produced=0, spent=0.0, unbilled=(), published=(), entries=None) -> Observed:
    """Every pod billed (an open entry while it runs) but `unbilled`; `entries`: the open entries instead."""
    billed = [p for p in pods if p not in unbilled]
    if entries is None:
        entries = {p.name: p.started_at for p in billed if p.phase == PodPhase.RUNNING}
    return Observed(
        pods=list(pods),
        prompt_backlog=prompts,
        sample_backlog=samples,
        samples_produced=produced,
        spent_dollars=spent,
        billed=frozenset(p.name for p in billed) | frozenset(entries),
        open_entries=entries,
        now=NOW,
        published=frozenset(published),
    )


W0 = pod("r-rollout-0", "rollout", slot="0")
W1 = pod("r-rollout-1", "rollout", slot="1")
T1 = pod("r-train-1", "training", iteration="1")
T1_OK = pod("r-train-1", "training", PodPhase.SUCCEEDED, 0, iteration="1")
T1_FAIL = pod("r-train-1", "training", PodPhase.FAILED, 1, iteration="1")
T1_KILLED = pod("r-train-1", "training", PodPhase.FAILED, -9, iteration="1")
T3_STOPPED = pod("r-train-3", "training", PodPhase.FAILED, -15, iteration="3")
T1_END_UNKNOWN = dataclasses.replace(T1_OK, ended_at=None)
W0_DEAD = pod("r-rollout-0", "rollout", PodPhase.FAILED, -9, slot="0")
CANCELLING = run(
    status=RunStatus.CANCELLING,
    prompts_published=2,
    worker_slots_used=1,
    ending_status=RunStatus.CANCELLED,
    ending_reason="cancelled by the user",
)

CASES = [
    ("pending run starts", run(status=RunStatus.PENDING), seen(), [StartRun("r")]),
    (
        "run cancelled while pending ends at once",
        run(
            status=RunStatus.CANCELLING, ending_status=RunStatus.CANCELLED, ending_reason="cancelled before it started"
        ),
        seen(),
        [FinishRun("r", RunStatus.CANCELLED, "cancelled before it started")],
    ),
    (
        "empty queue: one batch of prompts, pool sized to it",
        run(),
        seen(),
        [PublishPrompts("r", 0, 2), LaunchWorker("r", 0)],
    ),
    (
        "prompts queued and a worker on them: nothing to do",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0], prompts=2),
        [],
    ),
    (
        "backlog beyond one worker batch grows the pool to max",
        run(prompts_published=6, worker_slots_used=1),
        seen([W0], prompts=6, samples=8),
        [LaunchWorker("r", 1), LaunchWorker("r", 2), LaunchTraining("r", 1)],
    ),
    (
        "no scale-down while prompts may be in a worker's hands",
        run(prompts_published=4, worker_slots_used=2),
        seen([W0, W1], prompts=2),
        [],
    ),
    (
        "idle pool shrinks to min",
        run(
            spec=SPEC.model_copy(update={"iterations": None, "target_mean_reward": 1.0}),
            prompts_published=4,
            worker_slots_used=2,
        ),
        seen([W0, W1, T1], samples=16),
        [StopPod("r-rollout-1")],
    ),
    (
        "full batch waiting: launch training iteration 1",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0], samples=8, produced=8),
        [RecordProgress("r", 8), LaunchTraining("r", 1)],
    ),
    (
        "while training, the next batch is generated",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0, T1], samples=8),
        [PublishPrompts("r", 2, 2)],
    ),
    (
        "never two training jobs at once; all needed samples queued, so the pool stops",
        run(prompts_published=4, worker_slots_used=1),
        seen([W0, T1], prompts=0, samples=16),
        [StopPod("r-rollout-0")],
    ),
    (
        "finished training job is recorded and reaped",
        run(),
        seen([W0, T1_OK], samples=8),
        [RecordIteration("r", 1), ReapPod(T1_OK)],
    ),
    (
        "an ended job whose entry is still open (its scheduler died before reaping it) is billed up to its end",
        run(),
        seen([W0, T1_OK], samples=8, entries={W0.name: NOW - 10, T1_OK.name: NOW - 10}),
        [CloseEntry(T1_OK.name, NOW - 1, PodOutcome.SUCCEEDED), RecordIteration("r", 1), ReapPod(T1_OK)],
    ),
    (
        "an ended pod whose end the launcher does not know is left to ReapPod",
        run(),
        seen([W0, T1_END_UNKNOWN], samples=8, entries={W0.name: NOW - 10, T1_OK.name: NOW - 10}),
        [RecordIteration("r", 1), ReapPod(T1_END_UNKNOWN)],
    ),
    (
        "failed training job is retried after backoff",
        run(),
        seen([W0, T1_FAIL], samples=8),
        [RecordTrainingFailure("r", 1, 1, NOW + retry_delay(1)), ReapPod(T1_FAIL)],
    ),
    (
        "no relaunch before the backoff passes",
        run(prompts_published=2, worker_slots_used=1, train_failures=1, next_train_at=NOW + 5),
        seen([W0], samples=8),
        [],
    ),
    (
        "too many failures fail the run",
        run(train_failures=1),
        seen([W0, T1_FAIL], samples=8),
        [
            BeginEnding(
                "r",
                RunStatus.FAILED,
                "training job for iteration 1 failed 2 times (last exit code 1); see `spotrl logs r-train-1`",
            ),
            ReapPod(T1_FAIL),
        ],
    ),
    (
        "a killed worker is reaped, then replaced next tick",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0_DEAD], prompts=2),
        [ReapPod(W0_DEAD)],
    ),
    (
        "replacement gets a new slot",
        run(prompts_published=2, worker_slots_used=1),
        seen([], prompts=2),
        [LaunchWorker("r", 1)],
    ),
    (
        "last batch queued, nothing more needed: pool goes to zero",
        run(iterations_done=1, prompts_published=4, worker_slots_used=2),
        seen([W0, W1], samples=8),
        [StopPod("r-rollout-0"), StopPod("r-rollout-1"), LaunchTraining("r", 2)],
    ),
    (
        "iterations reached: stop pods",
        run(iterations_done=2),
        seen([W0]),
        [BeginEnding("r", RunStatus.SUCCEEDED, "trained 2 iterations"), StopPod("r-rollout-0")],
    ),
    (
        "ending and all pods gone: finish",
        run(
            status=RunStatus.ENDING,
            iterations_done=2,
            ending_status=RunStatus.SUCCEEDED,
            ending_reason="trained 2 iterations",
        ),
        seen([]),
        [FinishRun("r", RunStatus.SUCCEEDED, "trained 2 iterations")],
    ),
    (
        "cancel stops everything, training included",
        CANCELLING,
        seen([W0, T1], prompts=2, samples=8),
        [StopPod("r-rollout-0"), StopPod("r-train-1")],
    ),
    (
        "cancelling: a job that finished is still recorded, nothing is launched",
        CANCELLING,
        seen([T1_OK], samples=8),
        [RecordIteration("r", 1), ReapPod(T1_OK)],
    ),
    (
        "cancelling: a stopped job is reaped, not counted as a failure",
        dataclasses.replace(CANCELLING, train_failures=1),
        seen([W0, T1_FAIL]),
        [ReapPod(T1_FAIL)],
    ),
    # A defect once: the last job had published v3 (and maybe committed) when the cancel's
    # SIGTERM ended it; it was reaped unrecorded, so the run reported v2 and its samples vanished.
    (
        "cancelling: a job stopped after publishing its result is still an iteration",
        dataclasses.replace(CANCELLING, iterations_done=2),
        seen([T3_STOPPED], published=[3]),
        [RecordIteration("r", 3), ReapPod(T3_STOPPED)],
    ),
    (
        "a job killed between publishing and committing is an iteration, not a failure",
        run(),
        seen([W0, T1_KILLED], samples=8, published=[1]),
        [RecordIteration("r", 1), ReapPod(T1_KILLED)],
    ),
    (
        "ending: a job that failed after publishing is an iteration",
        run(status=RunStatus.ENDING, ending_status=RunStatus.FAILED, ending_reason="budget exhausted"),
        seen([T1_FAIL], published=[1]),
        [RecordIteration("r", 1), ReapPod(T1_FAIL)],
    ),
    (
        "cancelling, pods gone, samples left: dropped a bounded chunk at a time",
        CANCELLING,
        seen([], samples=8),
        [DropLeftovers("r", MAX_LEFTOVERS_PER_TICK // 4)],
    ),  # groups of 4 samples
    (
        "cancelling, pods gone, nothing left: cancelled",
        CANCELLING,
        seen([], samples=0),
        [FinishRun("r", RunStatus.CANCELLED, "cancelled by the user")],
    ),
    (
        "ending keeps its end though the budget is spent meanwhile",
        run(
            status=RunStatus.ENDING,
            iterations_done=2,
            ending_status=RunStatus.SUCCEEDED,
            ending_reason="trained 2 iterations",
        ),
        seen([W0], spent=9.0),
        [StopPod("r-rollout-0")],
    ),
    (
        "budget spent fails the run",
        run(iterations_done=1),
        seen([], spent=5.0),
        [
            BeginEnding(
                "r",
                RunStatus.FAILED,
                "budget exhausted: spent $5.00 of $5.00 after 1 iterations (policy v1 is published)",
            ),
            FinishRun(
                "r",
                RunStatus.FAILED,
                "budget exhausted: spent $5.00 of $5.00 after 1 iterations (policy v1 is published)",
            ),
        ],
    ),
    (
        "a pod its dead scheduler did not bill is billed first",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0, T1], samples=8, unbilled=[T1]),
        [BillPod(T1), PublishPrompts("r", 2, 2)],
    ),
    (
        "an entry opened for a pod never launched (its scheduler died) is closed with nothing billed",
        run(prompts_published=2, worker_slots_used=2),
        seen([W0], prompts=2, entries={W0.name: NOW - 10, "r-rollout-1": NOW - 3}),
        [CloseEntry("r-rollout-1", NOW - 3)],
    ),
    (
        "a running pod whose entry was closed (its launch raised, yet it started) is billed from its start",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0], prompts=2, entries={}),
        [BillPod(W0)],
    ),
    (
        "an ended pod with a closed entry is only reaped",
        run(prompts_published=2, worker_slots_used=1),
        seen([W0_DEAD], prompts=2, entries={}),
        [ReapPod(W0_DEAD)],
    ),
    (
        "terminal run with a leftover pod: stop it, start nothing",
        run(status=RunStatus.SUCCEEDED),
        seen([W0], samples=8),
        [StopPod("r-rollout-0")],
    ),
]


@pytest.mark.parametrize(("state", "observed", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan(state: RunState, observed: Observed, expected: list) -> None:
    assert plan(state, observed) == expected


def test_job_that_committed_no_longer_holds_a_batch() -> None:
    # Between its commit and its exit, a job's batch has left the backlog: don't count it twice.
    state = run(prompts_published=4, worker_slots_used=1, train_launch_committed=0)
    assert plan(state, dataclasses.replace(seen([W0, T1], samples=8), trainer_committed=8)) == [StopPod("r-rollout-0")]
    assert plan(state, seen([W0, T1], samples=8)) == [PublishPrompts("r", 4, 2)]


def test_a_huge_batch_is_published_a_bounded_chunk_per_tick() -> None:
    # 40M samples = 10M prompts: one tick publishing them all took minutes while other runs waited.
    huge = SPEC.model_copy(update={"batch_samples": 40_000_000})
    first = plan(run(spec=huge), seen())
    assert first[0] == PublishPrompts("r", 0, MAX_PROMPTS_PER_TICK)
    # Level-triggered: the next tick sees the batch still short and publishes the next chunk.
    later = plan(
        run(spec=huge, prompts_published=MAX_PROMPTS_PER_TICK, worker_slots_used=3),
        seen([W0, W1, pod("r-rollout-2", "rollout", slot="2")], prompts=MAX_PROMPTS_PER_TICK),
    )
    assert later == [PublishPrompts("r", MAX_PROMPTS_PER_TICK, MAX_PROMPTS_PER_TICK)]
    # The last chunk is what is still missing.
    nearly = 10_000_000 - 5
    assert plan(
        run(spec=huge, prompts_published=nearly, worker_slots_used=3),
        seen([W0, W1, pod("r-rollout-2", "rollout", slot="2")], prompts=nearly),
    ) == [PublishPrompts("r", nearly, 5)]


def test_target_reward_ends_run() -> None:
    spec = SPEC.model_copy(update={"iterations": None, "target_mean_reward": 0.9})
    assert plan(run(spec=spec, iterations_done=3, last_mean_reward=0.95), seen()) == [
        BeginEnding("r", RunStatus.SUCCEEDED, "mean reward 0.950 reached the target 0.9"),
        FinishRun("r", RunStatus.SUCCEEDED, "mean reward 0.950 reached the target 0.9"),
    ]


def test_target_reward_run_keeps_one_batch_ahead_without_limit() -> None:
    spec = SPEC.model_copy(update={"iterations": None, "target_mean_reward": 0.9})
    actions = plan(run(spec=spec, iterations_done=40, prompts_published=160, worker_slots_used=1), seen([W0]))
    assert actions == [PublishPrompts("r", 160, 2)]


def test_retry_delay_grows_and_is_capped() -> None:
    assert [retry_delay(k) for k in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert retry_delay(50) == 300.0


def test_a_pod_waiting_for_a_node_is_billed_from_a_boot_before_its_node_joined() -> None:
    """No machine is billed before one is started for the pod: while it waits (no spot capacity),
    its entry's start follows now - NODE_BOOT_SECONDS a minute at a time; once its node has
    joined, the entry starts a boot before that (services.control.cost.billing)."""
    state = run(prompts_published=2, worker_slots_used=1)
    waiting = dataclasses.replace(W0, waiting_for_node=True)
    ledger = [
        a for a in plan(state, seen([waiting], prompts=2, entries={W0.name: NOW - 300})) if isinstance(a, DeferEntry)
    ]
    assert ledger == [DeferEntry(W0.name, NOW - NODE_BOOT_SECONDS)]
    recent = NOW - NODE_BOOT_SECONDS - DEFER_STEP_SECONDS + 1  # moved on less than a step ago: not yet again
    assert not [
        a for a in plan(state, seen([waiting], prompts=2, entries={W0.name: recent})) if isinstance(a, DeferEntry)
    ]

    placed = dataclasses.replace(W0, node_joined_at=NOW - 20)  # its node joined 20 s ago
    ledger = [
        a for a in plan(state, seen([placed], prompts=2, entries={W0.name: NOW - 300})) if isinstance(a, DeferEntry)
    ]
    assert ledger == [DeferEntry(W0.name, NOW - 20 - NODE_BOOT_SECONDS)]
    # A node that was up before the pod's launch (a warm node, an idle one): billed from the launch.
    older_node = dataclasses.replace(W0, node_joined_at=NOW - 3600)
    assert not [
        a for a in plan(state, seen([older_node], prompts=2, entries={W0.name: NOW - 300})) if isinstance(a, DeferEntry)
    ]


def test_the_state_of_a_stored_run_reads_every_column_it_names() -> None:
    row = RunRow(
        id="r",
        status="ENDING",
        spec=SPEC.model_dump(mode="json"),
        iterations_done=2,
        last_mean_reward=0.5,
        prompts_published=6,
        ending_status="FAILED",
        ending_reason="budget exhausted",
        train_failures=1,
        next_train_at=12.0,
        worker_slots_used=3,
        samples_produced=24,
        train_launch_committed=5,
        started_at=7.0,
    )
    state = RunState.of(row, SPEC, best_eval=(1, 0.25))
    assert state == run(
        status=RunStatus.ENDING,
        iterations_done=2,
        last_mean_reward=0.5,
        prompts_published=6,
        ending_status=RunStatus.FAILED,
        ending_reason="budget exhausted",
        train_failures=1,
        next_train_at=12.0,
        worker_slots_used=3,
        samples_produced=24,
        train_launch_committed=5,
        started_at=7.0,
        best_eval=(1, 0.25),
    )


def test_each_node_of_a_job_of_several_is_billed_under_its_own_entry() -> None:
    """A job of 2 nodes: an entry per node (``node_names``), each billed, deferred while no node
    holds the job, and closed at the job's end, as the job's one entry would be."""
    waiting = dataclasses.replace(T1, nodes=2, waiting_for_node=True)
    names = ["r-train-1-0", "r-train-1-1"]
    unbilled = match_ledger(seen([waiting], entries={}))
    assert unbilled == [BillPod(waiting, 0), BillPod(waiting, 1)] and [b.entry for b in unbilled] == names
    opened = dict.fromkeys(names, NOW - NODE_BOOT_SECONDS - DEFER_STEP_SECONDS - 1)
    assert match_ledger(seen([waiting], entries=opened)) == [
        DeferEntry(name, NOW - NODE_BOOT_SECONDS) for name in names
    ]
    ended = dataclasses.replace(T1_FAIL, nodes=2)
    assert match_ledger(seen([ended], entries=dict.fromkeys(names, NOW - 10))) == [
        CloseEntry(name, NOW - 1, PodOutcome.FAILED) for name in names
    ]
    # A node's entry left open without its job (a launch that died midway) is closed with nothing billed.
    assert match_ledger(seen([], entries={names[1]: NOW - 3})) == [CloseEntry(names[1], NOW - 3)]
