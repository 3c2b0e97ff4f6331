"""What a tracker is to spotrl: a sink that takes a run's points, and the error it raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.control.tracking.points import Point


class TrackingError(Exception):
    """A tracker refused or could not be reached; the sync is retried later. The message names the
    tracker and what failed, never a credential."""


class Sink(Protocol):
    """One tracker. ``name`` keys the run's cursor of this sink in the state store."""

    name: str

    def write(self, run_id: str, points: Sequence[Point]) -> None:
        """Send ``points`` (in step order, iterations and evaluations mixed) to the run's record
        in the tracker, creating it on first use. A write repeated after a crash (the same points
        from the same first step, perhaps with more) logs no point twice where the tracker allows
        it. ``TrackingError`` when the tracker fails."""
        ...

    def end_run(self, run_id: str, status: str, ended_at: float) -> None:
        """Mark the run's record ended with spotrl's terminal ``status`` (SUCCEEDED, FAILED,
        CANCELLED) at unix time ``ended_at``, and let go of what was held open for it."""
        ...

    def close(self) -> None:
        """Let go of connections and open runs (the process is stopping; runs go on)."""
        ...
