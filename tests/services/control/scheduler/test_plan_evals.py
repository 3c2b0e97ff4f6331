"""The pure ``plan`` with a held-out eval: which versions are evaluated, once each, beside training
(never holding it up), retried then given up, and how they meet the run's end."""

from __future__ import annotations

import dataclasses

import pytest

from contracts.status import RunStatus
from services.control.scheduler.evals import EVAL_MAX_RETRIES, LaunchEval, RecordEval, RecordEvalFailure
from services.control.scheduler.plan import (
    BeginEnding,
    FinishRun,
    LaunchTraining,
    LaunchWorker,
    PublishPrompts,
    ReapPod,
    StopPod,
    plan,
)
from services.control.scheduler.run_state import EvalState, RunState, retry_delay
from services.ports.launcher.launcher import PodPhase
from tests.services.control.scheduler.test_plan import NOW, SPEC, W0, pod, run, seen

EVAL = {"prompts": [{"prompt": "2+2", "answer": "4"}], "every_iterations": 2, "samples_per_prompt": 2}
SPEC_EVAL = SPEC.model_validate({**SPEC.model_dump(mode="json"), "iterations": 6, "eval": EVAL})


def evaluating(**changes) -> RunState:
    return run(spec=SPEC_EVAL, **changes)


def eval_pod(version: int, phase: PodPhase = PodPhase.RUNNING, exit_code: int | None = None, **changes):
    return dataclasses.replace(pod(f"r-eval-{version}", "eval", phase, exit_code, version=str(version)), **changes)


def launches(actions: list) -> list[int]:
    return [a.version for a in actions if isinstance(a, LaunchEval)]


def test_the_base_model_is_evaluated_from_the_first_tick_beside_rollout() -> None:
    assert plan(evaluating(), seen()) == [PublishPrompts("r", 0, 2), LaunchWorker("r", 0), LaunchEval("r", 0)]


@pytest.mark.parametrize(
    ("done", "launched", "expected"),
    [
        (1, 0, []),  # v1 is not chosen (every 2nd)
        (2, 0, [2]),
        (3, 2, []),
        (4, 2, [4]),
        (4, 4, []),  # launched already: never twice
    ],
)
def test_every_nth_version_is_evaluated_once(done: int, launched: int, expected: list[int]) -> None:
    state = evaluating(iterations_done=done, eval_launched_through=launched, prompts_published=8, worker_slots_used=1)
    assert launches(plan(state, seen([W0], prompts=2))) == expected


def test_a_restarted_scheduler_launches_nothing_twice() -> None:
    # What a new scheduler reads: the eval of v2 open, its pod running.
    state = evaluating(
        iterations_done=2,
        eval_launched_through=2,
        evals_open={2: EvalState()},
        prompts_published=8,
        worker_slots_used=1,
    )
    assert launches(plan(state, seen([W0, eval_pod(2)], prompts=2))) == []
    # Its predecessor died between opening the eval and launching the pod: the same pod, launched now.
    assert launches(plan(state, seen([W0], prompts=2))) == [2]


def test_eval_pods_are_not_rollout_workers_and_never_hold_training_up() -> None:
    state = evaluating(
        iterations_done=2,
        eval_launched_through=2,
        evals_open={2: EvalState()},
        prompts_published=8,
        worker_slots_used=1,
    )
    without = plan(state, seen([W0], prompts=2, samples=8))
    with_evals = plan(state, seen([W0, eval_pod(2)], prompts=2, samples=8))
    assert LaunchTraining("r", 3) in with_evals
    assert with_evals == [a for a in without if not isinstance(a, LaunchEval)]


def test_a_finished_eval_is_recorded_however_its_pod_ended() -> None:
    state = evaluating(iterations_done=2, eval_launched_through=2, evals_open={2: EvalState()}, worker_slots_used=1)
    ok, killed = eval_pod(2, PodPhase.SUCCEEDED, 0), eval_pod(2, PodPhase.FAILED, -15)
    assert plan(state, dataclasses.replace(seen([W0, ok]), evals_published=frozenset({2}))) == [
        RecordEval("r", 2),
        ReapPod(ok),
    ]
    assert plan(state, dataclasses.replace(seen([W0, killed]), evals_published=frozenset({2}))) == [
        RecordEval("r", 2),
        ReapPod(killed),
    ]


def test_a_failed_eval_is_retried_after_a_delay_then_given_up_and_the_run_goes_on() -> None:
    failed = eval_pod(2, PodPhase.FAILED, 1)
    first = evaluating(iterations_done=2, eval_launched_through=2, evals_open={2: EvalState()}, worker_slots_used=1)
    # Exit 0 without a result is a failure too: only the written result counts.
    for ended in (failed, eval_pod(2, PodPhase.SUCCEEDED, 0)):
        assert plan(first, seen([W0, ended])) == [RecordEvalFailure("r", 2, 1, NOW + retry_delay(1)), ReapPod(ended)]
    waiting = dataclasses.replace(first, evals_open={2: EvalState(1, NOW + 1)}, prompts_published=8)
    assert launches(plan(waiting, seen([W0], prompts=2))) == []
    due = dataclasses.replace(first, evals_open={2: EvalState(1, NOW)}, prompts_published=8)
    assert launches(plan(due, seen([W0], prompts=2))) == [2]

    last = dataclasses.replace(first, evals_open={2: EvalState(EVAL_MAX_RETRIES, 0.0)})
    actions = plan(last, seen([W0, failed]))
    reason = (
        f"eval of policy v2 failed {EVAL_MAX_RETRIES + 1} times (last exit code 1), given up; "
        "see `spotrl logs r-eval-2`"
    )
    assert actions == [RecordEvalFailure("r", 2, EVAL_MAX_RETRIES + 1, NOW, gave_up=reason), ReapPod(failed)]
    assert not any(isinstance(a, BeginEnding) for a in actions)


def test_the_eval_target_ends_the_run_succeeded() -> None:
    spec = SPEC_EVAL.model_copy(
        update={
            "iterations": None,
            "target_mean_reward": None,
            "eval": SPEC_EVAL.eval.model_copy(update={"target_score": 0.8}),
        }
    )
    below = run(
        spec=spec,
        iterations_done=2,
        eval_launched_through=2,
        best_eval=(2, 0.75),
        prompts_published=8,
        worker_slots_used=1,
    )
    assert not any(isinstance(a, BeginEnding) for a in plan(below, seen([W0], prompts=2)))
    reached = dataclasses.replace(below, best_eval=(2, 0.8))
    reason = "eval mean score 0.800 of policy v2 reached the target 0.8"
    assert plan(reached, seen([W0], prompts=2)) == [
        BeginEnding("r", RunStatus.SUCCEEDED, reason),
        StopPod("r-rollout-0"),
    ]


def test_a_run_that_succeeds_evaluates_its_last_version_and_waits_for_its_evals() -> None:
    # Iterations (6) reached: v6 is chosen anyway; the eval of v4 on its node is let finish, the workers stop.
    state = evaluating(iterations_done=6, eval_launched_through=4, evals_open={4: EvalState()}, worker_slots_used=1)
    ending = BeginEnding("r", RunStatus.SUCCEEDED, "trained 6 iterations")
    assert plan(state, seen([W0, eval_pod(4)])) == [ending, StopPod("r-rollout-0"), LaunchEval("r", 6)]
    stopping = dataclasses.replace(
        state,
        status=RunStatus.ENDING,
        ending_status=RunStatus.SUCCEEDED,
        ending_reason="trained 6 iterations",
        eval_launched_through=6,
        evals_open={4: EvalState(), 6: EvalState()},
    )
    assert plan(stopping, seen([eval_pod(4), eval_pod(6)])) == []  # waits for them
    assert plan(dataclasses.replace(stopping, evals_open={}), seen([])) == [
        FinishRun("r", RunStatus.SUCCEEDED, "trained 6 iterations")
    ]
    # One still waiting for spot capacity is not waited for: stopped and given up.
    unplaced = eval_pod(6, waiting_for_node=True)
    assert plan(stopping, seen([eval_pod(4), unplaced])) == [
        StopPod("r-eval-6"),
        RecordEvalFailure("r", 6, 0, NOW, gave_up="the run ended while the eval pod of policy v6 waited for a node"),
    ]


def test_a_cancelled_run_stops_its_evals_launches_none_and_counts_no_failure() -> None:
    cancelling = evaluating(
        status=RunStatus.CANCELLING,
        ending_status=RunStatus.CANCELLED,
        ending_reason="cancelled by the user",
        iterations_done=2,
        eval_launched_through=2,
        evals_open={2: EvalState()},
        worker_slots_used=1,
    )
    assert plan(cancelling, seen([W0, eval_pod(2)])) == [StopPod("r-rollout-0"), StopPod("r-eval-2")]
    stopped = eval_pod(2, PodPhase.FAILED, -15)
    assert plan(cancelling, seen([stopped])) == [ReapPod(stopped)]
    assert plan(cancelling, seen([])) == [FinishRun("r", RunStatus.CANCELLED, "cancelled by the user")]


def test_nothing_is_evaluated_after_the_run_ended() -> None:
    ended = evaluating(status=RunStatus.SUCCEEDED, iterations_done=6, eval_launched_through=4)
    assert plan(ended, seen([eval_pod(4)])) == [StopPod("r-eval-4")]
    assert plan(ended, seen()) == []


def test_without_an_eval_section_no_eval_is_launched() -> None:
    assert launches(plan(run(), seen())) == []
    assert (
        launches(
            plan(
                run(
                    iterations_done=2,
                    status=RunStatus.ENDING,
                    ending_status=RunStatus.SUCCEEDED,
                    ending_reason="trained 2 iterations",
                ),
                seen(),
            )
        )
        == []
    )
