"""What the API keeps between requests: runs' bills and runs as shown, each computed once and kept
for as long as the state store says that what it was computed from still stands.

- A run's bill (``Bill``: each ledger entry's dollars by its provider's rule, and their total):
  a ledger with no open entry stays the same ledger for as long as its stamp does
  (``LedgerStamp``: entries are only added, or changed while open), and its bill no longer
  depends on the time. Such a bill is kept by run, and the state store does not read the ledger
  again while its stamp is the kept one (``KnownLedgers``).
- A page of a run's cost (``CostPublic``), beside its bill, once the run has ended: keyed also by
  everything else the report reads, the run's start and end, its training terms and the prices
  of its instance types now (a live catalog moves spot prices, and the lower bound with them).
- A run as GET shows it (``RunPublic``), by the run's ``RunStamp`` (its columns and counts of
  all else shown), while its ledger is closed: one statement tells whether it still stands.

What depends on the time (an open ledger's bill, a running run's cost) is computed at every read,
as before. Nothing kept can go stale, so each API process keeps its own and replicas need not
agree. The least recently read go first once what is kept passes its bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.control.api.schemas import CostPublic, RunPublic
from services.control.cost.billing import billed_dollars
from services.control.cost.lower_bound import TrainingTerms
from services.ports.prices.catalog import InstancePrice, PriceCatalog
from services.ports.state.state_store import LedgerEntry, LedgerStamp, RunColumns, RunStamp

MAX_KEPT_ENTRIES = 100_000  # ledger entries of the bills kept, in all (a few hundred bytes each)
MAX_KEPT_SHOWN = 50_000  # iterations and evals of the runs kept as shown, in all (about a KiB each)


@dataclass(frozen=True)
class CostKey:
    """What a page of an ended run's cost reads besides its closed ledger."""

    run_started_at: float | None
    run_ended_at: float | None
    training: TrainingTerms
    prices: tuple[InstancePrice, ...]  # of the run's instance types, sorted by name
    after: int | None  # the page: after the entry of this id, at most ``limit`` entries
    limit: int


@dataclass
class Bill:
    """A run's ledger (``stamp``, ``entries``, oldest first) and what each entry cost (``billed``,
    ``services.control.cost.billing.billed_dollars``), up to the time it was billed at where an
    entry is open; ``total`` is what the run spent (``spent_dollars``)."""

    stamp: LedgerStamp
    entries: Sequence[LedgerEntry]
    billed: list[float]
    total: float
    instance_types: tuple[str, ...]  # of its entries, sorted
    cost: tuple[CostKey, CostPublic] | None = field(default=None, compare=False)  # the last page of cost read

    @classmethod
    def of(cls, entries: Sequence[LedgerEntry], catalog: PriceCatalog, now: float) -> Bill:
        billed = billed_dollars(entries, catalog, now)
        return cls(
            stamp=LedgerStamp.of(entries),
            entries=entries,
            billed=billed,
            total=sum(billed),  # spent_dollars(entries, catalog, now), without billing them twice
            instance_types=tuple(sorted({e.instance_type for e in entries})),
        )

    def kept_cost(self, key: CostKey) -> CostPublic | None:
        kept = self.cost  # one read: another request may replace the pair meanwhile
        return kept[1] if kept is not None and kept[0] == key else None


@dataclass(frozen=True)
class Shown:
    """A run as GET showed it (``public``, with its ``latest`` iterations), and what the run stood at then."""

    stamp: RunStamp
    latest: int
    public: RunPublic


V = TypeVar("V")


class _Lru(Generic[V]):
    """Values by run, the least recently read dropped first once their sizes pass ``bound``; thread-safe."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._values: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, run_id: str) -> V | None:
        with self._lock:
            kept = self._values.get(run_id)
            if kept is None:
                return None
            self._values.move_to_end(run_id)
            return kept[0]

    def put(self, run_id: str, value: V, size: int) -> None:
        if size > self.bound:
            return
        with self._lock:
            old = self._values.pop(run_id, None)
            if old is not None:
                self._size -= old[1]
            self._values[run_id] = (value, size)
            self._size += size
            while self._size > self.bound:
                _, (_, dropped) = self._values.popitem(last=False)
                self._size -= dropped


class Kept:
    """What one API process keeps (see the module's docstring); each request reads it through a ``KeptReader``."""

    def __init__(
        self, catalog: PriceCatalog, *, max_entries: int = MAX_KEPT_ENTRIES, max_shown: int = MAX_KEPT_SHOWN
    ) -> None:
        self.catalog = catalog
        self.bills: _Lru[Bill] = _Lru(max_entries)
        self.shown: _Lru[Shown] = _Lru(max_shown)

    def reader(self) -> KeptReader:
        return KeptReader(self)


class KeptReader:
    """One request's reading of what is kept. A bill it finds (``known``) is held for the request,
    so that another request dropping it meanwhile changes nothing."""

    def __init__(self, kept: Kept) -> None:
        self._kept = kept
        self._held: dict[str, Bill] = {}

    def known(self, run_id: str) -> LedgerStamp | None:
        """The stamp of the run's closed ledger whose bill is kept (``KnownLedgers``); None: none is."""
        bill = self._kept.bills.get(run_id)
        if bill is None:
            return None
        self._held[run_id] = bill
        return bill.stamp

    def bill(self, run_id: str, ledger: Sequence[LedgerEntry] | None, now: float) -> Bill:
        """The bill of the run's ``ledger`` as the state store read it, billed at ``now``: None is
        the kept ledger ``known`` gave the stamp of; a closed ledger's bill is kept."""
        if ledger is None:
            return self._held[run_id]
        bill = Bill.of(ledger, self._kept.catalog, now)
        if bill.stamp.closed:
            self._kept.bills.put(run_id, bill, max(1, len(bill.entries)))
        return bill

    def cost_key(self, run: RunColumns, bill: Bill, *, after: int | None, limit: int) -> CostKey | None:
        """The key of a page of the run's cost; None while it reads the time (an open ledger, a run going)."""
        if not bill.stamp.closed or (run.started_at is not None and run.ended_at is None):
            return None
        training = TrainingTerms.of_stored(run.spec)
        types = sorted({training.instance_type, *bill.instance_types})
        prices = tuple(self._kept.catalog.get(t) for t in types)
        return CostKey(run.started_at, run.ended_at, training, prices, after, limit)

    def shown(self, run_id: str, latest: int) -> Shown | None:
        """The run as GET last showed it with ``latest`` iterations, if kept (to check against its stamp)."""
        shown = self._kept.shown.get(run_id)
        return shown if shown is not None and shown.latest == latest else None

    def keep_shown(self, run_id: str, shown: Shown) -> None:
        """Keep the run as shown, if its ledger was closed (else what it spent moves with the time)."""
        if shown.stamp.ledger.closed:
            self._kept.shown.put(run_id, shown, 1 + len(shown.public.iterations) + len(shown.public.evals))
