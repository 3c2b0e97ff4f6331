"""``rollout.gpus_per_worker``: what the spec accepts and refuses, and the share of its node a
worker (and an eval pod) is billed, where the pool's nodes hold several workers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.control.cost.billing import RolloutTerms
from services.domain.runspec import COLOCATED, RunSpec
from services.ports.prices.catalog import load_catalog

BASE = {"model": "tiny", "prompts": [{"prompt": "1+1=", "answer": "2"}], "iterations": 1}
# 4 x A10 and 4 x L20 for rollout, trained on 8 x A100-80GB, all priced in CNY.
ALIBABA = {"training": {"instance_type": "ecs.gn7e-c16g1.32xlarge"}}


def _spec(rollout: dict, **fields: object) -> RunSpec:
    return RunSpec.model_validate(BASE | ALIBABA | {"rollout": rollout} | fields)


def test_one_gpu_per_worker_by_default_and_a_divisor_of_the_nodes_gpus() -> None:
    assert RunSpec.model_validate(BASE).rollout.gpus_per_worker == 1
    spec = _spec({"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 2})
    node = load_catalog().get("ecs.gn7i-4x.8xlarge")  # 4 x A10
    terms = RolloutTerms.of_stored(spec.model_dump(mode="json"))
    # Two workers per node, each billed half of it; an eval pod likewise; a training pod its whole node.
    assert [terms.share(role, node) for role in ("rollout", "eval", "training", "standby")] == [0.5, 0.5, 1.0, 1.0]
    one_gpu = RolloutTerms.of_stored(_spec({"instance_type": "ecs.gn7i-4x.8xlarge"}).model_dump(mode="json"))
    assert one_gpu.share("rollout", node) == 0.25
    # A run stored before the setting: one GPU per worker.
    assert RolloutTerms.of_stored({"rollout": {"instance_type": "g6.xlarge"}}) == RolloutTerms(1)


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        # More GPUs than the node has: the default g6.xlarge has one L4.
        (
            {"gpus_per_worker": 2},
            "gpus_per_worker 2 does not divide the 1 GPUs of g6.xlarge: set gpus_per_worker to one of 1",
        ),
        (
            {"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 3},
            "does not divide the 4 GPUs of ecs.gn7i-4x.8xlarge: set gpus_per_worker to one of 1, 2, 4",
        ),
        # Every place a spot worker may run must hold whole workers, options included.
        (
            {
                "instance_type": "ecs.gn7i-4x.8xlarge",
                "gpus_per_worker": 2,
                "options": [{"instance_type": "ecs.gn7i-c8g1.2xlarge"}],
            },
            "does not divide the 1 GPUs of ecs.gn7i-c8g1.2xlarge",
        ),
    ],
    ids=["above-the-node", "not-a-divisor", "an-option"],
)
def test_gpus_per_worker_that_no_node_divides_into_is_refused(rollout: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _spec(rollout)


def test_out_of_range_and_colocated_are_refused() -> None:
    for n in (0, 9):
        with pytest.raises(ValidationError, match="gpus_per_worker"):
            _spec({"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": n})
    spec = BASE | ALIBABA | {"rollout": {"instance_type": "ecs.gn7i-4x.8xlarge", "gpus_per_worker": 2}}
    with pytest.raises(ValidationError, match="rollout.gpus_per_worker above 1"):
        RunSpec.model_validate(spec, context=COLOCATED)
