"""``run_end``: the one reading of a run's end conditions that the scheduler and a colocated run share."""

from __future__ import annotations

import pytest

from contracts.status import RunStatus
from services.domain.run_end import RunEnd, run_end
from services.domain.runspec import RunSpec

SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": "1+1", "answer": "2"}],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 3,
        "target_mean_reward": 0.9,
        "budget_dollars": 5.0,
        "eval": {"prompts": [{"prompt": "2+2", "answer": "4"}], "target_score": 0.8},
    }
)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({}, None),
        ({"iterations_done": 3}, ("iterations", RunStatus.SUCCEEDED)),
        ({"last_mean_reward": 0.9}, ("target_mean_reward", RunStatus.SUCCEEDED)),
        ({"best_eval": (2, 0.85)}, ("eval.target_score", RunStatus.SUCCEEDED)),
        ({"spent_dollars": 5.0}, ("budget_dollars", RunStatus.FAILED)),
        # A goal met on the iteration that spent the budget is a success.
        ({"iterations_done": 3, "spent_dollars": 6.0}, ("iterations", RunStatus.SUCCEEDED)),
        ({"last_mean_reward": 0.95, "spent_dollars": 6.0}, ("target_mean_reward", RunStatus.SUCCEEDED)),
        ({"best_eval": (1, 0.9), "spent_dollars": 6.0}, ("eval.target_score", RunStatus.SUCCEEDED)),
        # Several goals met: the first in order names the end.
        ({"iterations_done": 3, "last_mean_reward": 0.95, "best_eval": (3, 0.9)}, ("iterations", RunStatus.SUCCEEDED)),
        ({"last_mean_reward": 0.5, "best_eval": (1, 0.7), "spent_dollars": 4.99}, None),
    ],
)
def test_goals_come_before_the_budget(state: dict, expected: tuple[str, RunStatus] | None) -> None:
    end = run_end(SPEC, **{"iterations_done": 0, "last_mean_reward": None, "spent_dollars": 0.0, **state})
    assert (None if end is None else (end.goal, end.status)) == expected


def test_reasons_say_what_was_reached() -> None:
    assert run_end(SPEC, iterations_done=1, last_mean_reward=0.2, spent_dollars=5.0) == RunEnd(
        "budget_dollars",
        RunStatus.FAILED,
        "budget exhausted: spent $5.00 of $5.00 after 1 iterations (policy v1 is published)",
    )
    assert run_end(SPEC, iterations_done=1, last_mean_reward=0.2, spent_dollars=0.0, best_eval=(1, 0.8)).reason == (
        "eval mean score 0.800 of policy v1 reached the target 0.8"
    )
