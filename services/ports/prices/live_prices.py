"""Live AWS spot prices, over the catalog's.

With ``SPOTRL_LIVE_PRICES`` on, an AWS instance type's spot price is EC2's
``describe_spot_price_history`` now: the latest price of each availability zone of the
catalog's region, Linux/UNIX, and their median (the scheduler does not pick the zone; the
node pool's allocation strategy does). Each answer, and each failure, is kept for
``SPOTRL_LIVE_PRICES_TTL_S``, so a tick never waits on EC2 more than once per TTL.

Whatever goes wrong (no credentials, EC2 unreachable, the type unknown to the region) the
catalog's figure is used, a warning says so, and the price's ``origin`` tells where its spot
figure came from; the ledger keeps that beside every entry opened with it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import cache
from typing import Any

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from services.ports.prices.catalog import InstancePrice, PriceCatalog

log = logging.getLogger(__name__)

# A tick must not hang on EC2: short timeouts, one retry.
_EC2_CONFIG = Config(connect_timeout=3, read_timeout=10, retries={"total_max_attempts": 2})


@dataclass(frozen=True)
class _Fetched:
    at: float  # when EC2 was asked (clock seconds)
    spot: float | None  # None: no live price, for ``reason``
    detail: str  # where the price came from, or why there is none


class AwsSpotPrices:
    """Spot prices from EC2, per (region, instance type), each reused for ``ttl_s``."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._fetched: dict[tuple[str, str], _Fetched] = {}
        self._lock = threading.Lock()  # the API's threads share one instance

    def apply(self, price: InstancePrice) -> InstancePrice:
        """``price`` with its spot figure live where one is to be had; else as it is, saying so."""
        if price.provider != "aws":
            return price
        fetched = self._current(price.region, price.instance_type)
        if fetched.spot is None:
            return replace(price, origin=f"catalog spot price: no live price ({fetched.detail})")
        return replace(price, spot=fetched.spot, origin=fetched.detail)

    def _current(self, region: str, instance_type: str) -> _Fetched:
        key = (region, instance_type)
        with self._lock:
            fetched = self._fetched.get(key)
            if fetched is None or self._clock() - fetched.at >= self.ttl_s:
                fetched = self._fetched[key] = self._fetch(region, instance_type)
        return fetched

    def _fetch(self, region: str, instance_type: str) -> _Fetched:
        now = self._clock()
        session = _session(region)
        if session.get_credentials() is None:
            return self._failed(now, instance_type, "no AWS credentials in the environment")
        try:
            answer = session.client("ec2", config=_EC2_CONFIG).describe_spot_price_history(
                InstanceTypes=[instance_type],
                ProductDescriptions=["Linux/UNIX"],
                StartTime=datetime.fromtimestamp(now, UTC),
            )
        except (BotoCoreError, ClientError) as e:
            return self._failed(now, instance_type, f"EC2 describe_spot_price_history failed: {e}")
        latest = _latest_per_zone(answer.get("SpotPriceHistory", []))
        if not latest:
            return self._failed(now, instance_type, f"EC2 has no spot price history for it in {region}")
        spot = statistics.median(latest.values())
        when = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        detail = f"EC2 spot price history, {region}, median of {len(latest)} zones, {when}"
        return _Fetched(at=now, spot=spot, detail=detail)

    @staticmethod
    def _failed(now: float, instance_type: str, reason: str) -> _Fetched:
        log.warning("no live spot price for %s (%s): using the catalog's", instance_type, reason)
        return _Fetched(at=now, spot=None, detail=reason)


@cache
def _service_models() -> botocore.loaders.Loader:
    """One loader of botocore's service models for every session: each new session would
    parse EC2's model again (~1.5 s of CPU, measured)."""
    return botocore.loaders.create_loader()


def _session(region: str) -> boto3.session.Session:
    """A session of its own per fetch, so that it sees the environment's credentials as they are now."""
    core = botocore.session.get_session()
    core.register_component("data_loader", _service_models())
    return boto3.session.Session(botocore_session=core, region_name=region)


def _latest_per_zone(history: list[dict[str, Any]]) -> dict[str, float]:
    """Availability zone -> its latest spot price, from describe_spot_price_history records."""
    latest: dict[str, tuple[Any, float]] = {}
    for record in history:
        zone, when, price = record["AvailabilityZone"], record["Timestamp"], float(record["SpotPrice"])
        if zone not in latest or when > latest[zone][0]:
            latest[zone] = (when, price)
    return {zone: price for zone, (_, price) in latest.items()}


@dataclass(frozen=True)
class LivePriceCatalog(PriceCatalog):
    """The catalog, with AWS spot prices from EC2 where they can be had."""

    spot_prices: AwsSpotPrices

    def get(self, instance_type: str) -> InstancePrice:
        return self.spot_prices.apply(super().get(instance_type))
