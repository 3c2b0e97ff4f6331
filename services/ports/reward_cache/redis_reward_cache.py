"""The reward cache on Redis (redis-py): the production adapter of ``services.ports.reward_cache.reward_cache``.

A cache, so Redis being down must never stop a rollout worker: a lookup that fails returns no
hits (the worker scores the batch itself), a write that fails is dropped, and each key of such
a call counts as an ``error``. After a failure the adapter leaves Redis alone for
``retry_after_s`` (a circuit breaker: a dead Redis costs one short timeout per period, not one
per batch) and then tries again, so it recovers by itself. One warning per outage, one line
when it ends.

Each ``get_many`` is one ``MGET`` and each ``put_many`` one pipeline of ``SET key value EX ttl``
(no transaction): one round trip each, whatever the batch size.

The URL's password never appears in a log line or an error: messages name the server by
``redacted(url)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from prometheus_client import Counter
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from services.ports.reward_cache.reward_cache import RequestCounts, check_finite

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss")
KEY_PREFIX = "spotrl:reward:"
DEFAULT_TTL_S = 7 * 24 * 3600

# This process's counts (its default registry): what a scrape of the process itself would see.
# Each adapter also keeps its own ``requests`` (RequestCounts), which a rollout worker reports
# into the state store, so that one scrape of the API covers every worker of every run.
REQUESTS = Counter(
    "spotrl_reward_cache_requests",
    "Reward cache keys by result: hit or miss for each key looked up; error for each key not looked up "
    "or not written because the cache's server failed or was skipped after a failure.",
    ["result"],
)
for _result in ("hit", "miss", "error"):
    REQUESTS.labels(result=_result)  # exported at 0 from the start, so rates have a baseline


def redacted(url: str) -> str:
    """``url`` without its password (and without a query string, which may carry one), for messages."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<a malformed redis URL>"
    user = f"{parts.username}:***@" if parts.password is not None else (f"{parts.username}@" if parts.username else "")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return urlunsplit((parts.scheme, f"{user}{host}{port}", parts.path, "", ""))


class RedisRewardCache:
    """Rewards in Redis under ``key_prefix``, each kept ``ttl_s`` seconds (None: until evicted).

    ``url`` is ``redis://[[user]:password@]host[:port][/db]`` or ``rediss://`` for TLS.
    ``timeout_s`` bounds connecting and each read; ``retry_after_s`` is how long Redis is left
    alone after a failure.
    """

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = DEFAULT_TTL_S,
        key_prefix: str = KEY_PREFIX,
        connect_timeout_s: float = 0.5,
        timeout_s: float = 1.0,
        retry_after_s: float = 5.0,
    ) -> None:
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be at least 1 second (or None for no expiry), got {ttl_s}")
        self._where = redacted(url)
        try:
            if urlsplit(url).scheme not in SCHEMES:
                raise ValueError
            self._client = redis.Redis.from_url(
                url,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=timeout_s,
                # One immediate retry on a broken connection (a server restart or an idle
                # connection closed on its side), none on a timeout: a server that does not
                # answer has had its chance; redis-py's default retries 3 times with backoff.
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
                # Off: during a (Redis Cloud/Enterprise) maintenance notice redis-py would relax
                # the read timeout to 10 s, which a cache must not wait for.
                maint_notifications_config=MaintNotificationsConfig(enabled=False),
            )
        except ValueError:
            # redis-py's message may quote parts of the URL: say what is wrong without them.
            raise ValueError(
                f"the reward cache URL {self._where} is not a valid redis:// or rediss:// URL "
                "(redis://[[user]:password@]host[:port][/db])"
            ) from None
        self._ttl_s = ttl_s
        self._prefix = key_prefix
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic time of the outage's first failure
        self._retry_at = 0.0
        self.requests = RequestCounts()

    def __repr__(self) -> str:
        return f"RedisRewardCache({self._where})"

    def get_many(self, keys: Sequence[str]) -> dict[str, float]:
        unique = list(dict.fromkeys(keys))
        if not unique:
            return {}
        if not self._may_try():
            self._count("error", len(unique))
            return {}
        try:
            values = self._client.mget([self._prefix + k for k in unique])
        except redis.exceptions.RedisError as exc:
            self._failed("lookup", exc)
            self._count("error", len(unique))
            return {}
        self._succeeded()
        hits = {k: float(v) for k, v in zip(unique, values, strict=True) if v is not None}
        self._count("hit", len(hits))
        self._count("miss", len(unique) - len(hits))
        return hits

    def put_many(self, items: Mapping[str, float]) -> None:
        check_finite(items)
        if not items:
            return
        if not self._may_try():
            self._count("error", len(items))
            return
        pipe = self._client.pipeline(transaction=False)
        for key, value in items.items():
            # repr is the shortest text that reads back as the same float.
            pipe.set(self._prefix + key, repr(float(value)), ex=self._ttl_s)
        try:
            pipe.execute()
        except redis.exceptions.RedisError as exc:
            self._failed("write", exc)
            self._count("error", len(items))
            return
        self._succeeded()

    def close(self) -> None:
        self._client.close()

    def _count(self, result: str, n: int) -> None:
        REQUESTS.labels(result=result).inc(n)
        self.requests.add(result, n)

    # The circuit breaker: closed while Redis answers; open for retry_after_s after a failure;
    # then one call tries again (and either closes it or opens it for another period).

    def _may_try(self) -> bool:
        return time.monotonic() >= self._retry_at

    def _failed(self, what: str, exc: redis.exceptions.RedisError) -> None:
        now = time.monotonic()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
            self._retry_at = now + self._retry_after_s
        if first:
            log.warning(
                "reward cache %s: %s failed (%s: %s); carrying on without the cache (lookups miss, writes are "
                "dropped, each key counted as an error) and trying again every %.0f s; logged once per outage",
                self._where,
                what,
                type(exc).__name__,
                self._scrub(str(exc)),
                self._retry_after_s,
            )

    def _succeeded(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.info("reward cache %s answers again after %.1f s without it", self._where, time.monotonic() - since)

    def _scrub(self, text: str) -> str:
        """An error's text with the client's password masked, should the server or redis-py ever quote it."""
        password = self._client.connection_pool.connection_kwargs.get("password")
        return text.replace(password, "***") if password else text
