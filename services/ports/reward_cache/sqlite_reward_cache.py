"""The reward cache's embedded adapters: a dict in one process (``InProcessRewardCache``) and a SQLite
file shared by the processes of one machine (``SqliteRewardCache``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.ports.reward_cache.reward_cache import (
    RequestCounts,
    check_finite,
    count_lookup,
)
from services.ports.sqlite_file import SqliteFile


class InProcessRewardCache:
    """A dict in this process, evicting the least recently used entry beyond ``max_entries``."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._items: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self.requests = RequestCounts()

    def get_many(self, keys: Sequence[str]) -> dict[str, float]:
        unique = list(dict.fromkeys(keys))
        with self._lock:
            hits = {k: self._items[k] for k in unique if k in self._items}
            for key in hits:
                self._items.move_to_end(key)
        count_lookup(self.requests, len(unique), len(hits))
        return hits

    def put_many(self, items: Mapping[str, float]) -> None:
        check_finite(items)
        with self._lock:
            for key, value in items.items():
                self._items[key] = float(value)
                self._items.move_to_end(key)
            while len(self._items) > self._max_entries:
                self._items.popitem(last=False)

    def close(self) -> None:
        with self._lock:
            self._items.clear()


_SCHEMA = "CREATE TABLE IF NOT EXISTS rewards (key TEXT PRIMARY KEY, reward REAL NOT NULL) WITHOUT ROWID"
# Under SQLite's default limit on bound parameters per statement (32766), with room to spare.
_KEYS_PER_QUERY = 500


class SqliteRewardCache:
    """A SQLite file shared by the processes of one machine; entries are kept until the file is removed."""

    def __init__(self, path: Path) -> None:
        # synchronous=NORMAL: a cache may lose its last writes on power loss; they are recomputed.
        self._file = SqliteFile(path, schema=_SCHEMA, synchronous="NORMAL")
        self.requests = RequestCounts()

    def get_many(self, keys: Sequence[str]) -> dict[str, float]:
        unique = list(dict.fromkeys(keys))
        hits: dict[str, float] = {}
        with self._file.read() as conn:
            for i in range(0, len(unique), _KEYS_PER_QUERY):
                chunk = unique[i : i + _KEYS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                hits.update(conn.execute(f"SELECT key, reward FROM rewards WHERE key IN ({marks})", chunk))
        count_lookup(self.requests, len(unique), len(hits))
        return hits

    def put_many(self, items: Mapping[str, float]) -> None:
        check_finite(items)
        if not items:
            return
        with self._file.write() as conn:
            conn.executemany(
                "INSERT INTO rewards (key, reward) VALUES (?, ?) ON CONFLICT DO UPDATE SET reward = excluded.reward",
                [(k, float(v)) for k, v in items.items()],
            )

    def close(self) -> None:
        self._file.close()
