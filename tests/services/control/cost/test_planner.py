"""The planner: the seed's worked example to the cent, the pool-sizing and keep-warm rules, derived
training time and memory fit, and prices from the catalog or given directly in one currency."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.control.cost.plan_schemas import PlanRequest, plan_request
from services.control.cost.planner import PlanError
from services.ports.prices.catalog import parse_catalog

SEED = yaml.safe_load((Path(__file__).parents[4] / "examples" / "plan-seed.yaml").read_text())
CATALOG = parse_catalog(
    {
        "currency": "USD",
        "instances": {
            "l4": {
                "gpu": "L4",
                "gpus": 1,
                "provider": "t",
                "region": "t",
                "on_demand": 2.0,
                "spot": 0.8,
                "source": "t",
                "date": "t",
            },
            "a100x8": {
                "gpu": "A100-80GB",
                "gpus": 8,
                "provider": "t",
                "region": "t",
                "on_demand": 32.0,
                "spot": 16.0,
                "source": "t",
                "date": "t",
            },
        },
    }
)


def plan(**changes):
    return plan_request(PlanRequest.model_validate({**SEED, **changes}), CATALOG)


def with_rollout(**changes) -> list[dict]:
    return [{**SEED["rollout"][0], **changes}]


def with_training(**changes) -> list[dict]:
    return [{**SEED["training"][0], **changes}]


def test_the_seeds_worked_example_to_the_cent() -> None:
    p = plan()
    assert (p.rollout.instance_type, p.rollout_instances, p.rollout.capacity_type) == ("ecs.gn8is-L20", 4, "spot")
    assert (p.training.instance_type, p.training.gpus) == ("ecs.gn7e-2xA100", 2)
    # "That hour's work": 12,000 samples at 12,000 samples/h are one hour, and one 18-minute batch.
    assert p.rollout_seconds == p.update_seconds == 3600.0
    assert (p.rollout_cost, p.training_cost, p.cost_per_update) == (40.0, 72.0, 112.0)
    assert p.always_on_per_update == 960.0
    assert f"{p.saving:.0%}" == "88%"
    assert (p.updates_per_day, p.cost_per_day, p.always_on_per_day) == (24.0, 2688.0, 23040.0)
    assert not p.keep_training_warm  # a 42-minute gap, and no start-up to save
    terms = {t.name: t for t in p.terms}
    assert terms["per update"].arithmetic == "CNY 40.00 + CNY 72.00"
    assert "at CNY 10.00/h each for 60.0 min" in terms["rollout"].arithmetic
    assert "at CNY 240.00/h for 18.0 min" in terms["training"].arithmetic
    assert "at CNY 960.00/h for 60.0 min" in terms["always-on per update"].arithmetic


def test_the_pool_has_the_next_batch_ready_as_training_ends_and_training_stays_warm_through_a_short_gap() -> None:
    # Unbounded, 12,000 · 3600 / (3000 · 1080) = 13.3: 13 L20s take 18.46 min per batch, 0.46 min more than training.
    p = plan(rollout=with_rollout(max_instances=100), overheads={"node_start_seconds": 60, "model_load_seconds": 30})
    assert p.rollout_instances == 13
    assert p.update_seconds == pytest.approx(12000 * 3600 / (13 * 3000))
    assert p.keep_training_warm  # a 28 s gap against a 90 s restart
    assert p.training_billed_seconds == p.update_seconds
    assert p.cost_per_update == pytest.approx(13 * 10 * p.update_seconds / 3600 + 240 * p.update_seconds / 3600)
    assert p.updates_per_day == pytest.approx(86400 / p.update_seconds)


def test_a_restart_is_paid_when_the_gap_is_longer_than_the_start_up() -> None:
    p = plan(overheads={"node_start_seconds": 60, "image_pull_seconds": 20, "model_load_seconds": 10})
    assert not p.keep_training_warm
    assert p.training_billed_seconds == 1080 + 90
    assert p.training_cost == 240 * 1170 / 3600
    assert "+ 1.5 min start-up" in p.terms[1].arithmetic


def test_training_seconds_are_derived_and_shapes_that_cannot_hold_the_model_are_left_out() -> None:
    training = [
        {"instance_type": f"a100x{n}", "gpu": "A100-80GB", "gpus": n, "price_per_hour": 120.0 * n} for n in (1, 2, 4)
    ]
    p = plan(training=training, tokens_per_sample=1024, training_mfu=0.35, overheads={"node_start_seconds": 90})
    # 7e9 parameters x 16 bytes = 112 GB: one A100-80GB (64 GB usable) cannot hold it. Two and four
    # cost the same per batch (ideal scaling: 3151 s or 1575 s), but four pay twice the start-up.
    assert p.training.gpus == 2
    assert any("training[0]" in note and "112 GB" in note for note in p.notes)
    expected = 8 * 7e9 * 12000 * 1024 / (2 * 312e12 * 0.35)
    assert p.training_seconds_per_batch == pytest.approx(expected)
    assert p.training_cost == pytest.approx(240 * (expected + 90) / 3600)
    assert p.training_seconds_derived


def test_a_multi_node_update_holds_the_model_on_all_its_gpus_and_pays_for_every_node() -> None:
    """7e9 parameters need 112 GB: one A100-80GB cannot hold it, 2 nodes of one can, and train as
    fast as one instance of two GPUs; each node is paid, start-up included (all boot at once), and
    the default always-on cluster holds both."""
    one = {"instance_type": "a100x1", "gpu": "A100-80GB", "gpus": 1, "price_per_hour": 120.0}
    overheads = {"node_start_seconds": 90}
    rollout = with_rollout(on_demand_price_per_hour=20.0)
    kw = dict(tokens_per_sample=1024, training_mfu=0.35, overheads=overheads, always_on=None, rollout=rollout)
    with pytest.raises(PlanError, match="no training option holds the model"):
        plan(training=[one], **kw)
    p = plan(training=[{**one, "nodes": 2}], **kw)
    two_gpus = plan(training=[{**one, "instance_type": "a100x2", "gpus": 2, "price_per_hour": 240.0}], **kw)
    assert p.training.nodes == 2
    assert p.training_seconds_per_batch == pytest.approx(two_gpus.training_seconds_per_batch)
    assert p.training_cost == pytest.approx(2 * 120 * (p.training_seconds_per_batch + 90) / 3600)
    assert p.training_cost == pytest.approx(two_gpus.training_cost)
    assert p.always_on.price_per_hour == pytest.approx(p.rollout_instances * 20 + 2 * 120)
    assert p.always_on.instance_type.endswith("+ 2 x a100x1, on-demand")
    assert "2 x a100x1 (1 x A100-80GB, on-demand) at CNY 120.00/h each" in p.terms[1].arithmetic
    assert "(2 x A100-80GB peak x 35% MFU)" in p.terms[1].arithmetic


def test_the_rollout_gpu_cheapest_per_sample_wins() -> None:
    a10 = {
        "instance_type": "a10",
        "gpu": "A10",
        "gpus": 1,
        "price_per_hour": 8,
        "samples_per_hour_per_gpu": 2000,
        "max_instances": 4,
    }
    assert plan(rollout=[a10, SEED["rollout"][0]]).rollout.gpu == "L20"  # CNY 10 / 3000 beats CNY 8 / 2000
    assert (
        plan(rollout=[{**a10, "price_per_hour": 6}, SEED["rollout"][0]]).rollout.gpu == "A10"
    )  # 6 / 2000 beats 10 / 3000


def test_catalog_prices_and_the_default_always_on_cluster() -> None:
    p = plan(
        currency=None,
        always_on=None,
        model_params=1e9,
        rollout=[{"instance_type": "l4", "samples_per_second_per_gpu": 1.0, "max_instances": 2}],
        training=[{"instance_type": "a100x8", "seconds_per_batch": 1800}],
    )
    assert p.currency == "USD"
    assert (p.rollout.price_per_hour, p.training.price_per_hour) == (0.8, 32.0)  # spot rollout, on-demand training
    # 12,000 samples at 2 x 3600/h: 6000 s per update; always-on: both shapes on-demand that long.
    assert p.update_seconds == pytest.approx(12000 / 2.0)
    assert p.always_on_per_update == pytest.approx((2 * 2.0 + 32.0) * 6000 / 3600)


def test_inputs_no_plan_can_be_made_from_say_what_to_give() -> None:
    with pytest.raises(PlanError, match="give price_per_hour, gpu and gpus") as e:
        plan(rollout=with_rollout(instance_type="ecs.unknown", price_per_hour=None))
    assert e.value.loc == ("rollout", 0, "instance_type")
    with pytest.raises(PlanError, match="say their currency"):
        plan(currency=None)
    with pytest.raises(PlanError, match="catalog prices these options in USD"):
        plan(training=[{"instance_type": "a100x8", "seconds_per_batch": 600}])  # USD beside a plan in CNY
    with pytest.raises(PlanError, match="no on-demand price") as e:
        plan(always_on=None)
    assert e.value.loc == ("rollout", 0, "on_demand_price_per_hour")
    with pytest.raises(PlanError, match="no training option holds the model"):
        plan(model_params=1.2e10)  # 192 GB of training state on 2 x 80 GB (its 24 GB of weights fit an L20)
    with pytest.raises(PlanError, match="give seconds_per_batch") as e:
        plan(training=with_training(gpu="MI300X", seconds_per_batch=None))
    assert e.value.loc == ("training", 0, "seconds_per_batch")


def test_a_worker_of_several_gpus_must_hold_the_model_and_pays_for_its_gpus() -> None:
    # 13e9 parameters in BF16 are 26 GB: more than 60% of one L4's 24 GB, less than of two.
    l4x4 = {"instance_type": "l4x4", "gpu": "L4", "gpus": 4, "price_per_hour": 8, "samples_per_hour_per_gpu": 1000}
    big = {"model_params": 13e9, "training": with_training(gpus=4, price_per_hour=480)}
    with pytest.raises(PlanError, match="in a worker's GPUs: raise an option's gpus_per_worker") as refused:
        plan(**big, rollout=[l4x4])
    assert refused.value.loc == ("rollout",)
    p = plan(**big, rollout=[l4x4, {**l4x4, "instance_type": "l4x4-pairs", "gpus_per_worker": 2}])
    assert (p.rollout.instance_type, p.rollout.workers_per_instance) == ("l4x4-pairs", 2)
    assert any("rollout[0]: 1 x L4 left out" in n and "of a worker's memory is 14 GB" in n for n in p.notes)
    # Two workers of two GPUs make what four GPUs do: 4,000 samples/h an instance, CNY 2 per GPU-hour.
    assert p.rollout.samples_per_hour == 4000
    n = p.rollout_instances
    assert p.rollout_cost == pytest.approx(n * 8 * p.update_seconds / 3600)
    assert "(4 x L4, spot; 2 workers of 2 GPUs)" in p.terms[0].arithmetic
    # Workers must fill an instance's GPUs whole.
    with pytest.raises(PlanError, match="gpus_per_worker 3 does not divide the instance's 4 GPUs: give one of 1, 2, 4"):
        plan(rollout=[{**l4x4, "gpus_per_worker": 3}])


def test_a_workers_memory_not_the_instances_decides_the_fit() -> None:
    # 7e9 parameters (14 GB) fit one L4 (14.4 GB): workers of one GPU each, four to an instance.
    l4x4 = {"instance_type": "l4x4", "gpu": "L4", "gpus": 4, "price_per_hour": 8, "samples_per_hour_per_gpu": 1000}
    p = plan(rollout=[l4x4])
    assert (p.rollout.gpus_per_worker, p.rollout.workers_per_instance, p.rollout.samples_per_hour) == (1, 4, 4000)
    # 9e9 (18 GB) does not fit one: the four GPUs of an instance would, but no worker has them.
    with pytest.raises(PlanError, match="in a worker's GPUs"):
        plan(model_params=9e9, rollout=[l4x4], training=with_training(gpus=4, price_per_hour=480))
