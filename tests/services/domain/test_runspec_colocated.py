"""A colocated run (``spotrl train --colocated``) refuses, at validation, what only the
disaggregated loop's rollout workers do: DAPO dynamic sampling and ReMax's greedy baseline."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.domain.runspec import COLOCATED, RunSpec

BASE = {
    "model": "tiny",
    "prompts": [{"prompt": "1+1=", "answer": "2"}],
    "samples_per_prompt": 4,
    "batch_samples": 8,
    "iterations": 1,
}


@pytest.mark.parametrize(
    ("training", "named"),
    [
        ({"dynamic_sampling": True}, ["training.dynamic_sampling"]),
        ({"adv_estimator": "remax"}, ["training.adv_estimator remax"]),
        (
            {"dynamic_sampling": True, "adv_estimator": "remax"},
            ["training.dynamic_sampling", "training.adv_estimator remax"],
        ),
        ({"nodes": 2}, ["training.nodes above 1"]),
    ],
    ids=["dynamic-sampling", "remax", "both", "nodes"],
)
def test_a_colocated_spec_refuses_what_needs_rollout_workers_and_says_to_run_disaggregated(
    training: dict, named: list[str]
) -> None:
    data = {**BASE, "training": training}
    assert RunSpec.model_validate(data)  # a disaggregated run does both
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(data, context=COLOCATED)
    message = str(refused.value)
    assert all(name in message for name in named)
    assert "submit the spec as a disaggregated run" in message and "spotrl runs submit" in message
    with pytest.raises(ValueError, match="a colocated run cannot use"):
        RunSpec.model_validate(data).check_colocated()  # a spec built already, checked where it is run


def test_a_colocated_spec_without_them_is_accepted() -> None:
    spec = RunSpec.model_validate({**BASE, "training": {"adv_estimator": "rloo"}}, context=COLOCATED)
    assert spec.check_colocated() is spec


def test_a_colocated_spec_refuses_a_held_out_eval() -> None:
    data = {**BASE, "eval": {"prompts": [{"prompt": "2+2=", "answer": "4"}]}}
    assert RunSpec.model_validate(data).eval is not None  # the scheduler's eval pods evaluate a disaggregated run
    with pytest.raises(ValidationError, match="a colocated run cannot use eval"):
        RunSpec.model_validate(data, context=COLOCATED)
