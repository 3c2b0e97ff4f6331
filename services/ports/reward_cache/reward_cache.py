"""The reward cache port: rewards already computed, by a key over everything the reward depends on.

Adapters: ``InProcessRewardCache`` (one process), ``SqliteRewardCache`` (the processes of one
machine), and ``services.ports.reward_cache.redis_reward_cache.RedisRewardCache`` (one Redis shared by every
worker); all pass the same contract tests (tests/services/ports/reward_cache/test_reward_cache_contract.py),
Redis against a real redis-server.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol


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


def count_lookup(requests: RequestCounts, looked_up: int, hits: int) -> None:
    requests.add("hit", hits)
    requests.add("miss", looked_up - hits)


def check_finite(items: Mapping[str, float]) -> None:
    # SQLite stores NaN as NULL and Redis as the string "nan": reject it up front, in every adapter.
    bad = {k: v for k, v in items.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"rewards must be finite numbers; fix the reward function that returned {bad}")
