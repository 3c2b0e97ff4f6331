"""The simulator decides with the real scheduler's plan(), and a run spec's default policy is cost-aware."""

from __future__ import annotations

import pytest

from services.control.scheduler import loop
from services.control.scheduler import plan as plan_module
from services.control.scheduler.policies import POLICIES, cost_aware
from services.control.simulate import world
from services.control.simulate.traces import parse_trace
from services.control.simulate.world import Workload, simulate
from services.domain.runspec import CostPolicy, RunSpec

TRACE = parse_trace("steady", {"metadata": {"gap_seconds": 60}, "data": [4]})
SMALL = Workload(
    batch_samples=40,
    iterations=2,
    workers=2,
    max_workers=2,
    worker_samples_per_hour=3600.0,
    training_minutes=2.0,
    startup_seconds=60.0,
    horizon_days=0.05,
)


def test_a_run_spec_without_cost_policy_gets_cost_aware() -> None:
    spec = RunSpec.model_validate({"model": "tiny", "prompts": [{"prompt": "2+2?", "answer": "4"}], "iterations": 1})
    assert spec.cost_policy is CostPolicy.COST_AWARE
    assert POLICIES[spec.cost_policy] is cost_aware


def test_the_simulator_and_the_scheduler_call_one_plan() -> None:
    # Both look plan up on the module at each tick (``p.plan(...)``), so they run the same function.
    assert world.p is plan_module and loop.p is plan_module


def test_the_simulators_decisions_are_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    real = plan_module.plan
    assert simulate(TRACE, CostPolicy.THRESHOLD, SMALL).samples_trained == 2 * 40
    calls = []

    def no_training(run, observed):  # plan, less its training launches
        calls.append(observed.now)
        return [a for a in real(run, observed) if not isinstance(a, plan_module.LaunchTraining)]

    monkeypatch.setattr(plan_module, "plan", no_training)
    result = simulate(TRACE, CostPolicy.THRESHOLD, SMALL)
    assert calls and result.samples_trained == 0 and not result.finished
