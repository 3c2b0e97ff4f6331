"""The contract every RewardCache adapter passes; production adapters join ADAPTERS."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.ports.reward_cache.redis_reward_cache import RedisRewardCache
from services.ports.reward_cache.reward_cache import RewardCache, reward_cache_key
from services.ports.reward_cache.sqlite_reward_cache import InProcessRewardCache, SqliteRewardCache

# adapter name -> (a folder for its state, a getter of fixture values) -> a new client on an
# empty backing store; a real server's adapter takes its URL from that server's fixture
# (tests/servers/), which empties the server for each test.
ADAPTERS: dict[str, Callable[[Path, Callable[[str], Any]], RewardCache]] = {
    "in-process": lambda root, fixture: InProcessRewardCache(),
    "sqlite": lambda root, fixture: SqliteRewardCache(root / "rewards.db"),
    "redis": lambda root, fixture: RedisRewardCache(fixture("redis_url")),
}


@pytest.fixture(params=sorted(ADAPTERS))
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RewardCache]:
    client = ADAPTERS[request.param](tmp_path, request.getfixturevalue)
    yield client
    client.close()


def test_get_many_returns_only_the_hits(cache: RewardCache) -> None:
    assert cache.get_many([]) == {}
    assert cache.get_many(["a", "b"]) == {}
    cache.put_many({"a": 1.0, "b": -0.5})
    assert cache.get_many(["a", "b", "c", "a"]) == {"a": 1.0, "b": -0.5}


def test_a_key_put_again_takes_the_new_value(cache: RewardCache) -> None:
    cache.put_many({"a": 1.0})
    cache.put_many({"a": 0.25, "z": 0.0})
    assert cache.get_many(["a", "z"]) == {"a": 0.25, "z": 0.0}


def test_many_keys_at_once(cache: RewardCache) -> None:
    items = {reward_cache_key("prompt", str(i)): i / 7 for i in range(2000)}
    cache.put_many(items)
    assert cache.get_many(list(items) + ["missing"]) == items


def test_rewards_must_be_finite(cache: RewardCache) -> None:
    with pytest.raises(ValueError, match="finite"):
        cache.put_many({"good": 1.0, "bad": float("nan")})
    with pytest.raises(ValueError, match="finite"):
        cache.put_many({"bad": float("inf")})
    assert cache.get_many(["good", "bad"]) == {}


def test_reward_cache_key_separates_parts_unambiguously() -> None:
    key = reward_cache_key("ab", "c")
    assert len(key) == 64 and int(key, 16) >= 0
    assert key == reward_cache_key("ab", "c")
    assert key != reward_cache_key("a", "bc")
    assert key != reward_cache_key("abc")
    assert reward_cache_key("a", "") != reward_cache_key("a")
    assert reward_cache_key() != reward_cache_key("")


def test_in_process_cache_evicts_the_least_recently_used() -> None:
    cache = InProcessRewardCache(max_entries=2)
    cache.put_many({"a": 1.0, "b": 2.0})
    cache.get_many(["a"])  # b is now the least recently used
    cache.put_many({"c": 3.0})
    assert cache.get_many(["a", "b", "c"]) == {"a": 1.0, "c": 3.0}


def test_sqlite_cache_is_shared_with_other_processes(tmp_path: Path) -> None:
    path = tmp_path / "rewards.db"
    writer = (
        "import sys; from pathlib import Path; from services.ports.reward_cache.sqlite_reward_cache import SqliteRewardCache;"
        "c = SqliteRewardCache(Path(sys.argv[1])); c.put_many({'from-child': 0.5}); c.close()"
    )
    subprocess.run([sys.executable, "-c", writer, str(path)], check=True, timeout=60)
    cache = SqliteRewardCache(path)
    assert cache.get_many(["from-child"]) == {"from-child": 0.5}
    cache.close()


def test_requests_count_each_key_looked_up_once_by_result(cache: RewardCache) -> None:
    cache.put_many({"a": 1.0})
    cache.get_many(["a", "b", "a"])  # a key asked twice in one call is one lookup
    assert cache.requests.take() == {"hit": 1, "miss": 1, "error": 0}
    assert cache.requests.take() == {"hit": 0, "miss": 0, "error": 0}  # taken: counting starts again
