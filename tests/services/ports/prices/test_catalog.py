"""The shipped catalog's figures and their schema: a currency per instance, quoted ranges marked."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.domain.runspec import RunSpec
from services.ports.prices.catalog import MixedCurrencyError, QuotedRange, load_catalog, parse_catalog

SHIPPED = load_catalog()


def test_every_shipped_figure_names_its_source_date_and_currency() -> None:
    for price in SHIPPED.instances.values():
        assert price.source and price.date and price.currency in ("USD", "CNY"), price.instance_type
        assert 0 < price.spot <= price.on_demand, price.instance_type
    g4dn, p4de = SHIPPED.get("g4dn.xlarge"), SHIPPED.get("p4de.24xlarge")
    assert (g4dn.gpu, g4dn.gpus, g4dn.provider, g4dn.currency) == ("T4", 1, "aws", "USD")
    assert (p4de.gpu, p4de.gpus, p4de.provider, p4de.currency) == ("A100-80GB", 8, "aws", "USD")


@pytest.mark.parametrize(
    ("instance_type", "gpu", "low", "high"),
    [
        ("ecs.gn7i-4x.8xlarge", "A10", 15, 35),  # the seed: rollout A10/L20, 2-4 cards, CNY 15-35/h
        ("ecs.gn8is-4x.16xlarge", "L20", 15, 35),
        ("ecs.gn7e-c16g1.32xlarge", "A100-80GB", 120, 320),  # training A100/H100 80G, 4-8 cards, CNY 120-320/h
        ("ecs.gn7i-c8g1.2xlarge", "A10", 8, 25),  # reward T4/L4/A10, 1-2 cards, CNY 8-25/h
    ],
)
def test_alibaba_prices_are_the_seeds_quoted_ranges_in_cny(
    instance_type: str, gpu: str, low: float, high: float
) -> None:
    price = SHIPPED.get(instance_type)
    assert (price.provider, price.currency, price.gpu) == ("alibaba", "CNY", gpu)
    for capacity in ("on-demand", "spot"):
        quoted = price.quoted[capacity]
        assert (quoted.low, quoted.high) == (low, high)
        assert price.price(capacity) == quoted.point == (low + high) / 2  # the midpoint, said to be an estimate
        assert "seed" in quoted.basis or "quoted range" in quoted.basis
    assert "not an Alibaba list price" in price.source


def test_list_prices_carry_no_quoted_range() -> None:
    assert SHIPPED.get("g5.xlarge").quoted == {}


def test_a_quoted_range_whose_point_lies_outside_is_refused() -> None:
    with pytest.raises(ValueError, match="low <= point <= high"):
        QuotedRange(low=15, high=35, point=40, basis="x")


def test_an_instance_without_a_currency_takes_the_files() -> None:
    catalog = parse_catalog(
        {
            "currency": "EUR",
            "instances": {
                "x": {
                    "gpu": "L4",
                    "gpus": 1,
                    "provider": "test",
                    "region": "r",
                    "on_demand": 2,
                    "spot": 1,
                    "source": "s",
                    "date": "d",
                }
            },
        }
    )
    assert catalog.get("x").currency == "EUR" == catalog.currency_of(["x"])


def test_a_run_is_in_its_instances_one_currency() -> None:
    assert SHIPPED.currency_of(["g6.xlarge", "p4d.24xlarge"]) == "USD"
    assert SHIPPED.currency_of(["ecs.gn8is-4x.16xlarge", "ecs.gn7e-c16g1.32xlarge"]) == "CNY"
    with pytest.raises(MixedCurrencyError, match=r"CNY: ecs.gn7e-c16g1.32xlarge; USD: g6.xlarge"):
        SHIPPED.currency_of(["g6.xlarge", "ecs.gn7e-c16g1.32xlarge"])


def test_a_run_spec_mixing_currencies_is_refused_with_what_to_do() -> None:
    spec = {
        "model": "tiny",
        "prompts": [{"prompt": "1+1", "answer": "2"}],
        "iterations": 1,
        "rollout": {"instance_type": "g6.xlarge"},
        "training": {"instance_type": "ecs.gn7e-c16g1.32xlarge"},
    }
    with pytest.raises(ValidationError, match="different currencies.*use instance types of one provider"):
        RunSpec.model_validate(spec)
    spec["rollout"]["instance_type"] = "ecs.gn8is-4x.16xlarge"
    assert RunSpec.model_validate(json.loads(json.dumps(spec))).training.instance_type == "ecs.gn7e-c16g1.32xlarge"
