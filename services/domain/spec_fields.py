"""What every model of the run spec shares: strict validation, the length of a path, and
instance types known to the price catalog."""

from __future__ import annotations

from pydantic import ConfigDict

from services.ports.prices.catalog import load_catalog

MAX_PATH_CHARS = 1024
# Every model of the spec: numbers are finite (no NaN or infinity), unknown fields are refused.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


def known_instance_type(v: str) -> str:
    """``v`` if the price catalog knows the instance type, else a ValueError listing those it knows."""
    load_catalog().get(v)  # raises a ValueError that lists the known types
    return v
