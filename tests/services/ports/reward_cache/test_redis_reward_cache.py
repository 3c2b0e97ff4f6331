"""What the Redis reward cache promises beyond the port's contract, on a real redis-server
(tests/servers/redis.py): one round trip per batch, a TTL on every entry, Prometheus counters,
a worker that carries on while Redis is away and a cache that comes back by itself, and a
password that never reaches a log line or an error."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from prometheus_client import REGISTRY, generate_latest

from services.ports.reward_cache import redis_reward_cache
from services.ports.reward_cache.redis_reward_cache import KEY_PREFIX, RedisRewardCache
from services.ports.reward_cache.reward_cache import reward_cache_key
from services.ports.reward_cache.sqlite_reward_cache import SqliteRewardCache
from services.ports.wiring import open_reward_cache

LOGGER = "services.ports.reward_cache.redis_reward_cache"


@pytest.fixture
def cache(redis_url: str) -> Iterator[RedisRewardCache]:
    client = RedisRewardCache(redis_url)
    yield client
    client.close()


def _count(result: str) -> float:
    return REGISTRY.get_sample_value("spotrl_reward_cache_requests_total", {"result": result}) or 0.0


def _command_calls(raw: redis.Redis) -> dict[str, int]:
    """Commands the server ran since the last CONFIG RESETSTAT, by name (INFO commandstats)."""
    stats = raw.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
    return {name: n for name, n in calls.items() if name not in ("info", "config")}


class Clock:
    """The circuit breaker's clock, moved by the test: it stands still unless told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The adapter's ``time.monotonic`` (its breaker's only clock), held by the test; redis-py's own
    timeouts run on the real clock."""
    fake = Clock()
    monkeypatch.setattr(redis_reward_cache, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One entry per socket connection redis-py attempts (refused ones too)."""
    attempts: list[str] = []
    original = redis.connection.Connection._connect

    def counting(self: redis.connection.Connection) -> object:
        attempts.append(f"{self.host}:{self.port}")
        return original(self)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counting)
    return attempts


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of each write of commands that redis-py sends (one per round trip: a pipeline packs
    all its commands into one write before it reads any reply)."""
    writes: list[int] = []
    original = redis.connection.Connection.send_packed_command

    def counting(self: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        writes.append(sum(map(len, command)) if isinstance(command, list) else len(command))  # type: ignore[arg-type]
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    return writes


def test_a_batch_is_one_round_trip_each_way(cache: RedisRewardCache, redis_server, sends: list[int]) -> None:
    raw = redis_server.client()
    items = {reward_cache_key("p", str(i)): i / 3 for i in range(500)}
    cache.get_many(["warm-up"])  # connect first: a new connection's handshake is not the batch's cost
    raw.config_resetstat()
    sends.clear()

    cache.put_many(items)
    assert len(sends) == 1, f"put_many of 500 rewards took {len(sends)} writes"
    assert _command_calls(raw) == {"set": 500}  # SET ... EX each; no MULTI/EXEC, no separate EXPIRE

    raw.config_resetstat()
    sends.clear()
    assert cache.get_many([*items, "missing"]) == items
    assert len(sends) == 1
    assert _command_calls(raw) == {"mget": 1}
    raw.close()


def test_every_entry_gets_the_ttl(redis_url: str, redis_server, wait_for) -> None:
    raw = redis_server.client()
    week = RedisRewardCache(redis_url)
    week.put_many({"a": 1.0})
    assert 7 * 24 * 3600 - 60 < raw.ttl(KEY_PREFIX + "a") <= 7 * 24 * 3600
    forever = RedisRewardCache(redis_url, ttl_s=None)
    forever.put_many({"b": 1.0})
    assert raw.ttl(KEY_PREFIX + "b") == -1  # no expiry
    short = RedisRewardCache(redis_url, ttl_s=1)
    short.put_many({"c": 0.5})
    assert short.get_many(["c"]) == {"c": 0.5}
    wait_for(lambda: short.get_many(["c"]) == {}, timeout_s=30, message="the 1 s entry expired")
    assert week.get_many(["a"]) == {"a": 1.0}
    for c in (week, forever, short):
        c.close()
    raw.close()


def test_counters_count_hits_misses_and_errors(cache: RedisRewardCache) -> None:
    before = {r: _count(r) for r in ("hit", "miss", "error")}
    cache.put_many({"a": 1.0, "b": 2.0})
    cache.get_many(["a", "b", "c", "a"])
    down = RedisRewardCache("redis://127.0.0.1:1/0")  # nothing listens on port 1
    down.get_many(["x", "y"])
    down.put_many({"z": 1.0})
    down.close()
    assert {r: _count(r) - before[r] for r in before} == {"hit": 2, "miss": 1, "error": 3}
    # Each client's own counts too, which a rollout worker reports into the state store.
    assert cache.requests.take() == {"hit": 2, "miss": 1, "error": 0}
    assert down.requests.take() == {"hit": 0, "miss": 0, "error": 3}
    assert b'spotrl_reward_cache_requests_total{result="hit"}' in generate_latest(REGISTRY)


def test_redis_unreachable_a_while_then_back(
    redis_url: str, redis_server, sends: list[int], caplog, wait_for, clock
) -> None:
    """A hung Redis (SIGSTOP: connections accepted, nothing answers): worker-style calls miss and
    drop their writes, neither raising nor trying more than once (one timeout at most), with one
    warning; Redis is left alone until retry_after_s has passed, then tried once again; once it
    answers again the cache works without anyone reopening it."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    cache = RedisRewardCache(redis_url, connect_timeout_s=0.5, timeout_s=0.5, retry_after_s=60.0)
    cache.put_many({"before": 0.25})
    errors = _count("error")
    with redis_server.paused():
        sends.clear()
        tries = []  # the writes (round trips tried) of each call
        for i in range(20):
            for call in (
                functools.partial(cache.get_many, ["before", f"k{i}"]),
                functools.partial(cache.put_many, {f"k{i}": 1.0}),
            ):
                before = len(sends)
                assert call() in ({}, None)
                tries.append(len(sends) - before)
            clock.advance(2.0)  # 40 s in all: within retry_after_s
        # The breaker: the first call tried once (one timeout), the other 39 left Redis alone.
        assert tries == [1] + [0] * 39
        clock.advance(20.0)  # past retry_after_s: the next call tries again, once, and the breaker opens anew
        assert cache.get_many(["before"]) == {} and cache.get_many(["before"]) == {}
        assert len(sends) == 2
    assert _count("error") - errors == 20 * 2 + 20 + 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "carrying on without the cache" in warnings[0].getMessage()

    def answers() -> bool:
        clock.advance(60.0)  # each poll a period later, so the breaker lets it try
        return cache.get_many(["before"]) == {"before": 0.25}

    wait_for(answers, timeout_s=30, message="the cache answered again")
    cache.put_many({"after": 0.5})
    assert cache.get_many(["after"]) == {"after": 0.5}
    assert any("answers again" in r.getMessage() for r in caplog.records)
    cache.close()


def test_a_restarted_redis_is_used_again_without_an_error(start_redis) -> None:
    """A restart breaks the client's pooled connection; the next call reconnects on its own."""
    server = start_redis()
    cache = RedisRewardCache(server.url)
    cache.put_many({"a": 1.0})
    server.restart()  # same port, empty (nothing persisted)
    errors = _count("error")
    assert cache.get_many(["a"]) == {}
    cache.put_many({"a": 2.0})
    assert cache.get_many(["a"]) == {"a": 2.0}
    assert _count("error") == errors
    cache.close()


def test_nothing_listening_costs_little_and_raises_nothing(caplog, clock, connects: list[str]) -> None:
    cache = RedisRewardCache("redis://127.0.0.1:1/0", retry_after_s=5.0)
    for _ in range(50):
        assert cache.get_many(["a"]) == {}
        cache.put_many({"a": 1.0})
        clock.advance(0.01)
    # One try, refused (with redis-py's one immediate retry of a refused connection); the breaker
    # skips the other 99 calls.
    assert 1 <= len(connects) <= 2
    tried = len(connects)
    clock.advance(5.0)  # a period later: one call tries again, the next is skipped
    assert cache.get_many(["a"]) == {} and cache.get_many(["a"]) == {}
    assert len(connects) == 2 * tried
    assert cache.requests.take() == {"hit": 0, "miss": 0, "error": 50 * 2 + 2}
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    with pytest.raises(ValueError, match="finite"):  # a bad reward is still the caller's error
        cache.put_many({"a": float("nan")})
    cache.close()


def test_the_password_never_appears_in_logs_or_errors(start_redis, caplog, capsys) -> None:
    caplog.set_level(logging.DEBUG)
    password, wrong = "s3cret-Pw-8d1f", "wr0ng-Pw-77aa"
    server = start_redis(password=password)
    right_url = server.url
    wrong_url = right_url.replace(password, wrong)
    assert password in right_url

    good = RedisRewardCache(right_url, timeout_s=0.5)
    good.put_many({"a": 1.0})
    assert good.get_many(["a"]) == {"a": 1.0}
    bad = RedisRewardCache(wrong_url)
    assert bad.get_many(["a"]) == {}  # WRONGPASS: counted, logged, not raised
    bad.put_many({"b": 1.0})
    with server.paused():
        assert good.get_many(["a"]) == {}  # a timeout, logged with the server's address
    texts = [caplog.text, repr(good), repr(bad)]
    assert "127.0.0.1" in caplog.text and "***" in caplog.text

    refused: list[BaseException] = []
    for url in (
        f"memcached://:{password}@127.0.0.1:11211",
        f"redis://:{password}@127.0.0.1:notaport/0",
        f"unix://:{password}@/run/redis.sock",
    ):
        with pytest.raises(ValueError) as info:
            open_reward_cache(url, Path("/nonexistent"))
        refused.append(info.value)
    assert "redis://" in str(refused[0]) and "rediss://" in str(refused[0]) and "memcached" in str(refused[0])
    texts += ["".join(traceback.format_exception(e)) for e in refused]
    captured = capsys.readouterr()
    texts += [captured.out, captured.err]
    for text in texts:
        assert password not in text and wrong not in text
    good.close()
    bad.close()


def test_open_reward_cache_chooses_by_scheme(redis_url: str, tmp_path: Path) -> None:
    assert isinstance(open_reward_cache(None, tmp_path), SqliteRewardCache)
    cache = open_reward_cache(redis_url, tmp_path)
    assert isinstance(cache, RedisRewardCache)
    cache.put_many({"a": 1.0})
    assert cache.get_many(["a"]) == {"a": 1.0}
    cache.close()
    # TLS: the server of these tests is built without TLS, so only the client's choice is checked.
    tls = open_reward_cache("rediss://:pw@cache.example:6380/1", tmp_path)
    assert isinstance(tls, RedisRewardCache)
    kwargs = tls._client.connection_pool.connection_kwargs
    assert tls._client.connection_pool.connection_class is redis.connection.SSLConnection
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.example", 6380, 1)
    tls.close()
