"""The price catalog: what an instance type costs per hour, on-demand and spot, in which
currency, and where that figure came from.

A price in the catalog file is a number (a list price, or an indicative spot median) or a quoted
range ``{"low", "high", "point", "basis"}``: a range a source quotes for a class of machines
("A10/L20, 2-4 cards, CNY 15-35/h"), not a list price. The ``point`` is the figure used; the
range stays on the price (``quoted``) so that reports can say the figure is uncertain.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from services.core.config import get_settings

CAPACITY_TYPES = ("on-demand", "spot")


class UnknownInstanceTypeError(ValueError):
    """An instance type that the price catalog does not list."""


class MixedCurrencyError(ValueError):
    """A run whose instance types are priced in different currencies: its bill has no one currency."""


@dataclass(frozen=True)
class QuotedRange:
    """A price a source quotes as a range, not a list price; ``point`` is the figure used."""

    low: float
    high: float
    point: float
    basis: str  # who quotes it, for what, and how the point was chosen

    def __post_init__(self) -> None:
        if not self.low <= self.point <= self.high:
            raise ValueError(f"a quoted range needs low <= point <= high (got {self.low}, {self.point}, {self.high})")


@dataclass(frozen=True)
class InstancePrice:
    instance_type: str
    gpu: str
    gpus: int
    provider: str
    region: str
    on_demand: float
    spot: float
    source: str
    date: str
    currency: str = "USD"
    quoted: Mapping[str, QuotedRange] = field(default_factory=dict)  # capacity type -> its quoted range
    # Where the figures came from now: "catalog", or a live feed's description (live_prices).
    origin: str = "catalog"
    # The machine's size as its provider publishes it (None where the catalog does not say): what
    # the Kubernetes launcher sizes its pods' CPU and memory requests by.
    vcpus: int | None = None
    memory_gib: float | None = None

    def price(self, capacity_type: str) -> float:
        return self.spot if capacity_type == "spot" else self.on_demand

    def cheapest(self) -> float:
        return min(self.spot, self.on_demand)

    def described(self) -> str:
        """The price's source, as the ledger keeps it beside each entry."""
        text = f"{self.source} ({self.date})"
        return text if self.origin == "catalog" else f"{self.origin}; else {text}"


@dataclass(frozen=True)
class PriceCatalog:
    currency: str  # the file's default, for instances that name none
    instances: dict[str, InstancePrice]

    def get(self, instance_type: str) -> InstancePrice:
        try:
            return self.instances[instance_type]
        except KeyError:
            known = ", ".join(sorted(self.instances))
            raise UnknownInstanceTypeError(
                f"instance type {instance_type!r} is not in the price catalog; use one of: {known}"
            ) from None

    def currency_of(self, instance_types: Iterable[str]) -> str:
        """The one currency of these instance types' prices (a run's bill is in it)."""
        by_currency: dict[str, list[str]] = {}
        for name in sorted(set(instance_types)):
            by_currency.setdefault(self.get(name).currency, []).append(name)
        if len(by_currency) > 1:
            listed = "; ".join(f"{c}: {', '.join(names)}" for c, names in sorted(by_currency.items()))
            raise MixedCurrencyError(
                f"the run's instance types are priced in different currencies ({listed}); "
                "use instance types of one provider and currency, or price them in one currency in your own "
                "catalog (SPOTRL_PRICE_CATALOG)"
            )
        return next(iter(by_currency), self.currency)


def _parse_price(value: Any) -> tuple[float, QuotedRange | None]:
    if isinstance(value, Mapping):
        quoted = QuotedRange(
            low=float(value["low"]), high=float(value["high"]), point=float(value["point"]), basis=str(value["basis"])
        )
        return quoted.point, quoted
    return float(value), None


def _parse_instance(name: str, fields: Mapping[str, Any], default_currency: str) -> InstancePrice:
    fields = dict(fields)
    quoted: dict[str, QuotedRange] = {}
    prices: dict[str, float] = {}
    for capacity, key in zip(CAPACITY_TYPES, ("on_demand", "spot"), strict=True):
        prices[key], quoted_range = _parse_price(fields.pop(key))
        if quoted_range is not None:
            quoted[capacity] = quoted_range
    fields.setdefault("currency", default_currency)
    return InstancePrice(instance_type=name, **prices, **fields, quoted=quoted)


def parse_catalog(data: dict) -> PriceCatalog:
    default_currency = data.get("currency", "USD")
    instances = {name: _parse_instance(name, fields, default_currency) for name, fields in data["instances"].items()}
    return PriceCatalog(currency=default_currency, instances=instances)


def load_catalog(path: Path | None = None) -> PriceCatalog:
    """The catalog at ``path``, else at ``SPOTRL_PRICE_CATALOG`` (an operator's prices, e.g. a mounted
    ConfigMap), else the one shipped with spotrl."""
    return _read_catalog(path or get_settings().price_catalog)


@cache
def _read_catalog(path: Path | None) -> PriceCatalog:
    text = path.read_text() if path else resources.files("services.ports.prices").joinpath("catalog.json").read_text()
    return parse_catalog(json.loads(text))
