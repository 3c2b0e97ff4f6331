"""Spot capacity traces, SkyPilot spot-traces JSON:
``{"metadata": {"gap_seconds": N}, "data": [int per tick], "prices": [float per tick]?}``.

A tick's value is how many spot instances can be held during it (0/1 in single-node files).
The optional ``prices`` are the spot price per hour of one instance during each tick; they are
taken to be in the price catalog's currency of the rollout instance type (the trace format names
no currency), and the simulator bills spot rollout at them instead of the catalog's spot price.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


@dataclass(frozen=True)
class SpotTrace:
    name: str
    gap_seconds: float
    available: tuple[int, ...]
    prices: tuple[float, ...] | None = None  # per hour of one spot instance, one per tick; None: the catalog's

    def at(self, t: float) -> int:
        """Spot instances available at ``t`` seconds into the run; the trace repeats past its end."""
        return self.available[self._tick(t)]

    def price_at(self, t: float) -> float:
        """The spot price per hour at ``t`` seconds into the run (the trace must carry prices)."""
        return self._prices()[self._tick(t)]

    def spot_cost(self, start: float, end: float) -> float:
        """What holding one spot instance from ``start`` to ``end`` seconds costs, each tick's seconds
        at that tick's price: ticks of 60 s priced 1, 2 and 4 per hour bill 30 to 150 s as
        (30 x 1 + 60 x 2 + 30 x 4) / 3600 = 0.075."""
        return (self._price_seconds(end) - self._price_seconds(start)) / 3600.0

    def cheapest_price(self) -> float:
        """The lowest spot price of a tick that has spot capacity (of any tick if none has)."""
        prices = self._prices()
        held = [price for price, n in zip(prices, self.available, strict=True) if n > 0]
        return min(held or prices)

    def _tick(self, t: float) -> int:
        return int(t // self.gap_seconds) % len(self.available)

    def _prices(self) -> tuple[float, ...]:
        if self.prices is None:
            raise ValueError(f"trace {self.name} carries no prices; use the catalog's")
        return self.prices

    @cached_property
    def _cumulative(self) -> tuple[float, ...]:
        """Price x seconds from the trace's start to the start of each tick, and to its end (last)."""
        sums, total = [0.0], 0.0
        for price in self._prices():
            total += price * self.gap_seconds
            sums.append(total)
        return tuple(sums)

    def _price_seconds(self, t: float) -> float:
        """Price x seconds from 0 to ``t``, the trace repeating past its end."""
        n = len(self.available)
        periods, rest = divmod(max(0.0, t), n * self.gap_seconds)
        tick = min(int(rest // self.gap_seconds), n - 1)  # float noise must not reach past the last tick
        return (
            periods * self._cumulative[n]
            + self._cumulative[tick]
            + (rest - tick * self.gap_seconds) * self._prices()[tick]
        )


def parse_trace(name: str, data: dict) -> SpotTrace:
    try:
        gap = float(data["metadata"]["gap_seconds"])
        available = tuple(int(v) for v in data["data"])
        prices = None if data.get("prices") is None else tuple(float(v) for v in data["prices"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"trace {name}: expected SkyPilot spot-traces JSON, "
            '{"metadata": {"gap_seconds": N}, "data": [int per tick], "prices": [price per tick]?} '
            f"({type(e).__name__}: {e})"
        ) from None
    if gap <= 0 or not available or min(available) < 0:
        raise ValueError(f"trace {name}: gap_seconds must be > 0 and data a non-empty list of counts >= 0")
    if prices is not None and (len(prices) != len(available) or min(prices) < 0):
        raise ValueError(
            f"trace {name}: prices must hold one price >= 0 per tick of data "
            f"({len(prices)} prices for {len(available)} ticks)"
        )
    return SpotTrace(name=name, gap_seconds=gap, available=available, prices=prices)


def load_trace(path: Path) -> SpotTrace:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {path} is not JSON ({e}); give a SkyPilot spot-traces JSON file") from None
    return parse_trace(path.stem, data)


def traces_in(directory: Path) -> list[Path]:
    """The JSON traces under ``directory``, in a stable order."""
    found = sorted(directory.rglob("*.json"))
    if not found:
        raise FileNotFoundError(
            f"no *.json spot traces under {directory}; give --traces DIR with SkyPilot spot-traces JSON files"
        )
    return found
