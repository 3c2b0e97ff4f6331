"""What a run sends to experiment trackers: points, each a step's figures under verl's metric names.

A training iteration's point holds what its job recorded (``contracts.job_result.JobResult.metrics``:
``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/kl_ref``, ``critic/vf_loss``,
``response_length/mean``, ``reward/mean``, ``perf/tokens_per_s``, ``data/staleness_mean``, ...)
and what the control plane knows of it: ``timing_s/iteration`` (the job's wall time),
``data/samples_trained``, ``data/samples_dropped``, ``cost/dollars_so_far`` (the run's bill
when the iteration ended, from its ledger) and ``memory/<role>/max_bytes`` (the most memory a
pod of each role reported since the iteration before). Its step is the iteration number, which is also the
policy version it published.

A held-out evaluation's point is the caller's (``Point(step=policy_version, ...)``) with values
under ``eval/``: ``eval/mean_score``, ``eval/pass@4``. Its step is the policy version evaluated,
so evaluations line up with the iteration that published the version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.control.cost.billing import billed_dollars
from services.control.cost.cost_over_time import ledger_at
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_schema import IterationRow, PodMemoryRow
from services.ports.state.state_store import LedgerEntry

# Keys of held-out evaluations start with this; every other key is a training iteration's.
EVAL_PREFIX = "eval/"


@dataclass(frozen=True)
class Point:
    """The figures of one step: ``values`` by metric name (``area/name``), at unix time ``wall_time``."""

    step: int
    wall_time: float
    values: dict[str, float] = field(default_factory=dict)

    def is_eval(self) -> bool:
        """A held-out evaluation's point (every key under ``eval/``), not an iteration's."""
        return bool(self.values) and all(k.startswith(EVAL_PREFIX) for k in self.values)


def dollars_at(entries: Sequence[LedgerEntry], catalog: PriceCatalog, at: float) -> float:
    """The run's bill at unix time ``at``: its ledger as it stood then, billed by each provider's
    rule (``services.control.cost.billing``), the figure the cost report shows at that instant."""
    ledger = ledger_at(entries, at, now=at)
    return sum(billed_dollars(ledger, catalog, at))


def iteration_point(row: IterationRow, dollars_so_far: float, memory: dict[str, float] | None = None) -> Point:
    """The point of a finished iteration: its job's metrics (non-numbers and non-finite values,
    stored as null, left out), the control plane's figures of it, and ``memory``: the pods'
    memory since the iteration before (``memory_figures``)."""
    values = {
        key: float(v)
        for key, v in (row.metrics or {}).items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and not key.startswith(EVAL_PREFIX)
    }
    values.setdefault("reward/mean", row.mean_reward)
    values["timing_s/iteration"] = row.seconds
    values["data/samples_trained"] = float(row.samples_trained)
    values["data/samples_dropped"] = float(row.samples_dropped)
    values["cost/dollars_so_far"] = dollars_so_far
    values.update(memory or {})
    return Point(step=row.iteration, wall_time=row.ended_at, values=values)


def memory_figures(reports: Sequence[PodMemoryRow]) -> dict[str, float]:
    """``memory/<role>/max_bytes``: the most memory (GPU memory on a GPU, else RSS) any one pod of
    each role reported among ``reports`` (the pods report every 30 s)."""
    peaks: dict[str, float] = {}
    for r in reports:
        key = f"memory/{r.role or 'pod'}/max_bytes"
        peaks[key] = max(peaks.get(key, 0.0), r.bytes)
    return peaks


def eval_point(policy_version: int, wall_time: float, scores: dict[str, float]) -> Point:
    """A held-out evaluation of ``policy_version``: ``scores`` by name (``mean_score``, ``pass@4``)
    under ``eval/``."""
    values = {EVAL_PREFIX + k.removeprefix(EVAL_PREFIX): float(v) for k, v in scores.items()}
    return Point(step=policy_version, wall_time=wall_time, values=values)
