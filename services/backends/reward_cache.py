"""The reward cache port: rewards already computed, by a key over everything the reward depends on.

Adapters: ``InProcessRewardCache`` (one process), ``SqliteRewardCache`` (the processes of one
machine), and ``services.backends.redis_reward_cache.RedisRewardCache`` (one Redis shared by every
worker); all pass the same contract tests (tests/services/backends/test_reward_cache_contract.py),
Redis against a real redis-server.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from services.backends._sqlite import SqliteFile


class RequestCounts:
    """Keys looked up or written, by result, since the last ``take``: ``hit`` and ``miss`` for
    each key looked up, ``error`` for each key not looked up or not written because the cache
    failed. Every adapter keeps one (``requests``); a rollout worker takes them after each batch
    and reports them into the state store, whence the API's /metrics exports them by run."""

    RESULTS = ("hit", "miss", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.RESULTS, 0)

    def add(self, result: str, n: int) -> None:
        with self._lock:
            self._counts[result] += n

    def take(self) -> dict[str, int]:
        """The counts since the last take, and start again from zero."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self.RESULTS, 0)
        return counts


class RewardCache(Protocol):
    requests: RequestCounts

    def get_many(self, keys: Sequence[str]) -> dict[str, float]:
        """The cached rewards of ``keys``; keys never stored (or evicted) are left out."""
        ...

    def put_many(self, items: Mapping[str, float]) -> None:
        """Store rewards; a key stored again takes the new value. Rewards must be finite."""
        ...

    def close(self) -> None: ...


def reward_cache_key(*parts: str) -> str:
    """sha256 (hex) over ``parts``, each length-prefixed so ("ab", "c") and ("a", "bc") differ."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode()
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _count_lookup(requests: RequestCounts, looked_up: int, hits: int) -> None:
    requests.add("hit", hits)
    requests.add("miss", looked_up - hits)


def _check_finite(items: Mapping[str, float]) -> None:
    # SQLite stores NaN as NULL and Redis as the string "nan": reject it up front, in every adapter.
    bad = {k: v for k, v in items.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"rewards must be finite numbers; fix the reward function that returned {bad}")


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
        _count_lookup(self.requests, len(unique), len(hits))
        return hits

    def put_many(self, items: Mapping[str, float]) -> None:
        _check_finite(items)
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
        _count_lookup(self.requests, len(unique), len(hits))
        return hits

    def put_many(self, items: Mapping[str, float]) -> None:
        _check_finite(items)
        if not items:
            return
        with self._file.write() as conn:
            conn.executemany(
                "INSERT INTO rewards (key, reward) VALUES (?, ?) ON CONFLICT DO UPDATE SET reward = excluded.reward",
                [(k, float(v)) for k, v in items.items()],
            )

    def close(self) -> None:
        self._file.close()
