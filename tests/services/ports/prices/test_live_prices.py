"""Live AWS spot prices from EC2's describe_spot_price_history, against moto's real server (the
session's, tests/servers/s3.py: one moto server answers every AWS API). Moto answers each
instance type it offers in the region with one price per zone, $0.00001."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from services.core.config import Settings
from services.ports.prices.catalog import load_catalog, parse_catalog
from services.ports.prices.live_prices import AwsSpotPrices, LivePriceCatalog
from services.ports.wiring import open_prices
from tests.servers.process import free_port
from tests.servers.s3 import S3Server

MOTO_SPOT = 0.00001
SHIPPED = load_catalog()


@pytest.fixture
def ec2(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """The environment of a pod with AWS credentials, EC2 being the moto server; nothing of the
    machine's own AWS setup applies."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASPOTRLTESTKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def live(clock: Clock | None = None, ttl_s: float = 300.0) -> LivePriceCatalog:
    return LivePriceCatalog(SHIPPED.currency, SHIPPED.instances, AwsSpotPrices(ttl_s, clock or Clock()))


def test_an_aws_spot_price_comes_from_ec2_and_says_so(ec2: S3Server) -> None:
    price = live().get("g5.xlarge")
    assert price.spot == MOTO_SPOT and price.on_demand == SHIPPED.get("g5.xlarge").on_demand
    assert price.origin.startswith("EC2 spot price history, us-east-1, median of ")
    assert price.described().startswith("EC2 spot price history") and "else aws.amazon.com" in price.described()
    gcp = live().get("g2-standard-4")  # not AWS: the catalog's, untouched
    assert gcp == SHIPPED.get("g2-standard-4") and gcp.origin == "catalog"


def test_a_live_price_is_reused_for_its_ttl(ec2: S3Server) -> None:
    clock = Clock()
    catalog = live(clock, ttl_s=300.0)
    first = catalog.get("g5.xlarge").origin
    clock.now += 299.0
    assert catalog.get("g5.xlarge").origin == first  # the same answer: EC2 not asked again
    clock.now += 1.0
    again = catalog.get("g5.xlarge")
    assert again.origin != first and again.spot == MOTO_SPOT  # asked again, at the new time


def test_a_type_ec2_does_not_know_falls_back_to_the_catalog_saying_so(ec2: S3Server, caplog) -> None:
    own = parse_catalog(
        {
            "currency": "USD",
            "instances": {
                "x9.huge": {
                    "gpu": "L4",
                    "gpus": 1,
                    "provider": "aws",
                    "region": "us-east-1",
                    "on_demand": 2.0,
                    "spot": 0.7,
                    "source": "mine",
                    "date": "2025-06",
                }
            },
        }
    )
    catalog = LivePriceCatalog(own.currency, own.instances, AwsSpotPrices(300.0, Clock()))
    with caplog.at_level(logging.WARNING, logger="services.ports.prices.live_prices"):
        price = catalog.get("x9.huge")
    assert price.spot == 0.7
    assert price.origin == "catalog spot price: no live price (EC2 has no spot price history for it in us-east-1)"
    assert "no live spot price for x9.huge" in caplog.text and "using the catalog's" in caplog.text


def test_without_credentials_or_with_ec2_unreachable_the_catalog_is_used(
    ec2: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog_spot = SHIPPED.get("g5.xlarge").spot
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    unreachable = live().get("g5.xlarge")
    assert unreachable.spot == catalog_spot
    assert unreachable.origin.startswith("catalog spot price: no live price (EC2 describe_spot_price_history failed")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    anonymous = live().get("g5.xlarge")
    assert (anonymous.spot, anonymous.origin) == (
        catalog_spot,
        "catalog spot price: no live price (no AWS credentials in the environment)",
    )


def test_live_prices_are_a_setting(ec2: S3Server) -> None:
    assert open_prices(Settings(live_prices=False)) is SHIPPED
    on = open_prices(Settings(live_prices=True, live_prices_ttl_s=60))
    assert isinstance(on, LivePriceCatalog) and on.get("g4dn.xlarge").spot == MOTO_SPOT
