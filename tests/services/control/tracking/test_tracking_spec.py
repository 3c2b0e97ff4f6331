"""The run spec's `tracking` section: which trackers and where in them; never a URL or a credential."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.domain.runspec import RunSpec, Tracking

BASE = {"model": "tiny", "prompts": [{"prompt": "1+1=", "answer": "2"}], "iterations": 2, "batch_samples": 8}


def test_a_spec_names_its_trackers() -> None:
    spec = RunSpec.model_validate(
        {
            **BASE,
            "tracking": {
                "tensorboard": True,
                "mlflow": {"experiment": "gsm8k grpo"},
                "wandb": {"project": "spotrl", "entity": "my-team"},
            },
        }
    )
    assert spec.tracking == Tracking.model_validate(spec.model_dump()["tracking"])  # stored and read back alike
    assert (spec.tracking.tensorboard, spec.tracking.mlflow.experiment, spec.tracking.wandb.entity) == (
        True,
        "gsm8k grpo",
        "my-team",
    )
    assert RunSpec.model_validate(BASE).tracking is None


@pytest.mark.parametrize(
    "tracking",
    [
        {"mlflow": {"experiment": "e", "tracking_uri": "http://mlflow:5000"}},
        {"mlflow": {"experiment": "e", "token": "t"}},
        {"wandb": {"project": "p", "api_key": "k" * 40}},
        {"wandb": {"project": "team/p"}},
        {"mlflow": {"experiment": ""}},
        {"tensorboard": "yes please"},
        {"comet": {}},
    ],
)
def test_urls_credentials_and_unknown_trackers_are_refused(tracking: dict) -> None:
    with pytest.raises(ValidationError):
        RunSpec.model_validate({**BASE, "tracking": tracking})
