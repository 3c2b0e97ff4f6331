"""When a run is done: the end conditions of its spec, read alike by the scheduler and by a
colocated run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contracts.status import RunStatus
from services.domain.runspec import RunSpec


@dataclass(frozen=True)
class RunEnd:
    """Why a run is done: the spec field that ended it, the status it ends with, and the reason shown."""

    goal: Literal["iterations", "target_mean_reward", "eval.target_score", "budget_dollars"]
    status: RunStatus
    reason: str


def run_end(
    spec: RunSpec,
    *,
    iterations_done: int,
    last_mean_reward: float | None,
    spent_dollars: float,
    best_eval: tuple[int, float] | None = None,
) -> RunEnd | None:
    """The end a run has reached, or None while it goes on: the scheduler and a colocated run
    both ask this, so the two modes end a run alike. Its goals come first: a run whose last
    iteration reached a goal succeeded, even if that iteration spent the rest of the budget;
    the budget fails only a run still short of every goal. `best_eval` is (policy version,
    mean score) of the best recorded eval."""
    if spec.iterations is not None and iterations_done >= spec.iterations:
        return RunEnd("iterations", RunStatus.SUCCEEDED, f"trained {iterations_done} iterations")
    target = spec.target_mean_reward
    if target is not None and last_mean_reward is not None and last_mean_reward >= target:
        return RunEnd(
            "target_mean_reward", RunStatus.SUCCEEDED, f"mean reward {last_mean_reward:.3f} reached the target {target}"
        )
    target = spec.eval.target_score if spec.eval is not None else None
    if target is not None and best_eval is not None and best_eval[1] >= target:
        version, score = best_eval
        return RunEnd(
            "eval.target_score",
            RunStatus.SUCCEEDED,
            f"eval mean score {score:.3f} of policy v{version} reached the target {target}",
        )
    if spec.budget_dollars is not None and spent_dollars >= spec.budget_dollars:
        return RunEnd(
            "budget_dollars",
            RunStatus.FAILED,
            f"budget exhausted: spent ${spent_dollars:.2f} of ${spec.budget_dollars:.2f} "
            f"after {iterations_done} iterations (policy v{iterations_done} is published)",
        )
    return None
