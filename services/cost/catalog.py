"""The price catalog: what an instance type costs per hour, on-demand and spot, and where that figure came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from services.config import get_settings


class UnknownInstanceTypeError(ValueError):
    """An instance type that the price catalog does not list."""


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

    def price(self, capacity_type: str) -> float:
        return self.spot if capacity_type == "spot" else self.on_demand

    def cheapest(self) -> float:
        return min(self.spot, self.on_demand)


@dataclass(frozen=True)
class PriceCatalog:
    currency: str
    instances: dict[str, InstancePrice]

    def get(self, instance_type: str) -> InstancePrice:
        try:
            return self.instances[instance_type]
        except KeyError:
            known = ", ".join(sorted(self.instances))
            raise UnknownInstanceTypeError(
                f"instance type {instance_type!r} is not in the price catalog; use one of: {known}"
            ) from None


def parse_catalog(data: dict) -> PriceCatalog:
    instances = {
        name: InstancePrice(instance_type=name, **fields) for name, fields in data["instances"].items()
    }
    return PriceCatalog(currency=data["currency"], instances=instances)


def load_catalog(path: Path | None = None) -> PriceCatalog:
    """The catalog at ``path``, else at ``SPOTRL_PRICE_CATALOG`` (an operator's prices, e.g. a mounted
    ConfigMap), else the one shipped with spotrl."""
    return _read_catalog(path or get_settings().price_catalog)


@cache
def _read_catalog(path: Path | None) -> PriceCatalog:
    text = path.read_text() if path else resources.files("services.cost").joinpath("catalog.json").read_text()
    return parse_catalog(json.loads(text))
