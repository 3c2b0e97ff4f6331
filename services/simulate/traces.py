"""Spot capacity traces, SkyPilot spot-traces JSON: ``{"metadata": {"gap_seconds": N}, "data": [int per tick]}``.

A tick's value is how many spot instances can be held during it (0/1 in single-node files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpotTrace:
    name: str
    gap_seconds: float
    available: tuple[int, ...]

    def at(self, t: float) -> int:
        """Spot instances available at ``t`` seconds into the run; the trace repeats past its end."""
        return self.available[int(t // self.gap_seconds) % len(self.available)]


def parse_trace(name: str, data: dict) -> SpotTrace:
    try:
        gap = float(data["metadata"]["gap_seconds"])
        available = tuple(int(v) for v in data["data"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"trace {name}: expected SkyPilot spot-traces JSON, "
            '{"metadata": {"gap_seconds": N}, "data": [int per tick]} '
            f"({type(e).__name__}: {e})"
        ) from None
    if gap <= 0 or not available or min(available) < 0:
        raise ValueError(f"trace {name}: gap_seconds must be > 0 and data a non-empty list of counts >= 0")
    return SpotTrace(name=name, gap_seconds=gap, available=available)


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
        raise FileNotFoundError(f"no *.json spot traces under {directory}; give --traces DIR with SkyPilot spot-traces JSON files")
    return found
