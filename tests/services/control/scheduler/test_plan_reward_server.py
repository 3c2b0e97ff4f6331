"""The pure ``plan`` with a run's reward server: launched with the run, kept up (launched again
once reaped), stopped at its end, but kept while its evals finish."""

from __future__ import annotations

import dataclasses

from contracts.status import RunStatus
from services.control.scheduler.plan import BeginEnding, LaunchWorker, PublishPrompts, ReapPod, StopPod, plan
from services.control.scheduler.reward_server import LaunchRewardServer
from services.control.scheduler.run_state import EvalState
from services.ports.launcher.launcher import PodPhase
from tests.services.control.scheduler.test_plan import SPEC, W0, pod, run, seen
from tests.services.control.scheduler.test_plan_evals import EVAL, eval_pod

SERVED = {"fn": "function", "path": "/data/rewards/gsm8k.py:compute_score"}
SPEC_SERVED = SPEC.model_validate({**SPEC.model_dump(mode="json"), "reward": [SERVED], "reward_server": {}})
REWARD_POD = pod("r-reward", "reward")


def serving(**changes):
    return run(spec=SPEC_SERVED, **changes)


def test_the_reward_server_starts_with_the_run_beside_the_rollout_pool_and_only_once() -> None:
    assert plan(serving(), seen()) == [PublishPrompts("r", 0, 2), LaunchWorker("r", 0), LaunchRewardServer("r")]
    running = serving(prompts_published=2, worker_slots_used=1)
    assert not any(isinstance(a, LaunchRewardServer) for a in plan(running, seen([W0, REWARD_POD], prompts=2)))
    assert not any(
        isinstance(a, LaunchRewardServer)
        for a in plan(run(prompts_published=2, worker_slots_used=1), seen([W0], prompts=2))
    )


def test_a_reward_server_that_ended_is_reaped_then_launched_again() -> None:
    running = serving(prompts_published=2, worker_slots_used=1)
    preempted = pod("r-reward", "reward", PodPhase.FAILED, -15)
    assert plan(running, seen([W0, preempted], prompts=2)) == [ReapPod(preempted)]
    assert LaunchRewardServer("r") in plan(running, seen([W0], prompts=2))


def test_it_stops_with_the_run_but_serves_the_evals_a_succeeded_run_waits_for() -> None:
    cancelling = serving(
        status=RunStatus.CANCELLING,
        ending_status=RunStatus.CANCELLED,
        ending_reason="cancelled by the user",
        worker_slots_used=1,
    )
    assert plan(cancelling, seen([W0, REWARD_POD])) == [StopPod("r-rollout-0"), StopPod("r-reward")]

    spec = SPEC_SERVED.model_validate(
        {**SPEC_SERVED.model_dump(mode="json"), "iterations": 2, "eval": {**EVAL, "every_iterations": 1}}
    )
    done = run(spec=spec, iterations_done=2, eval_launched_through=2, evals_open={2: EvalState()}, worker_slots_used=1)
    actions = plan(done, seen([W0, REWARD_POD, eval_pod(2)]))
    assert actions[0] == BeginEnding("r", RunStatus.SUCCEEDED, "trained 2 iterations")
    assert StopPod("r-rollout-0") in actions and StopPod("r-reward") not in actions  # the eval of v2 scores through it
    finished = dataclasses.replace(
        done,
        status=RunStatus.ENDING,
        ending_status=RunStatus.SUCCEEDED,
        ending_reason="trained 2 iterations",
        evals_open={},
    )
    assert plan(finished, seen([REWARD_POD])) == [StopPod("r-reward")]
