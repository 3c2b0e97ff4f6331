"""How the control plane's cost grows with the number of active runs and their pods.

For each store (SQLite, and PostgreSQL: a real server started as the tests start it) and each
number of active runs, the bench stores the runs as the API does, gives each one a past
(``--history`` trained iterations, a ledger entry per training job), and lets the real scheduler
tick: its launcher is the scheduler tests' ``ScriptedLauncher`` (pods that run nothing; each run
keeps its WORKERS rollout workers), its queue and object store the embedded ones.
It prints, per size: the tick's p50 and p99, the tick per run (flat when no tick reads all
history), the store's size, and the p99 of ``GET /v1/runs/{id}`` through the API app in-process.

    PYTHONPATH=$PWD .venv/bin/python bench/scheduler_scale.py             # 10 and 100 runs
    PYTHONPATH=$PWD .venv/bin/python bench/scheduler_scale.py --runs 1000 --store postgresql

``--kafka`` prints the partitions the runs' topics take on a Kafka cluster instead, from the layout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.domain.runspec import RunSpec
from services.ports.state.state_store import StateStore
from services.ports.wiring import Backends, open_backends
from tests.iteration_rows import past_training_job
from tests.services.control.scheduler.conftest import ScriptedLauncher, submit_run

WORKERS = 4  # rollout workers per run: its pods
SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": "1+1=", "answer": "2"}],
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 100_000,
        "rollout": {"min_workers": WORKERS, "max_workers": WORKERS, "prompts_per_batch": 2},
    }
)
HEADER = (
    f"{'runs':>6} {'pods':>6} {'store':<10} {'history':>7} {'tick p50':>9} {'tick p99':>9} "
    f"{'per run':>8} {'store MB':>9} {'GET p99':>8}"
)


@dataclasses.dataclass(frozen=True)
class Row:
    runs: int
    pods: int
    store: str
    history: int
    ticks: list[float]
    store_bytes: int
    gets: list[float]

    def __str__(self) -> str:
        p50, p99 = _quantile(self.ticks, 0.5), _quantile(self.ticks, 0.99)
        return (
            f"{self.runs:>6} {self.pods:>6} {self.store:<10} {self.history:>7} {p50 * 1e3:>7.0f}ms "
            f"{p99 * 1e3:>7.0f}ms {p50 / self.runs * 1e3:>6.2f}ms {self.store_bytes / 2**20:>9.1f} "
            f"{_quantile(self.gets, 0.99) * 1e3:>6.1f}ms"
        )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def give_history(state: StateStore, run_id: str, iterations: int, now: float) -> None:
    """``iterations`` past training jobs of the run: each its ledger entry, closed, and its iteration."""
    t = now - 60.0 * iterations - 60.0
    for i in range(1, iterations + 1):
        past_training_job(state, run_id, i, t, 40.0, price_source="scheduler_scale (seeded)", kl=0.01, loss=0.1)
        t += 60.0


def store_bytes(settings: Settings, backends: Backends) -> int:
    url = settings.resolved_state_url()
    if url.startswith("sqlite"):
        return sum(f.stat().st_size for f in settings.home.glob("state.db*"))  # its WAL too
    with backends.state._engine.connect() as conn:  # type: ignore[attr-defined]
        from sqlalchemy import text

        return int(conn.scalar(text("select pg_database_size(current_database())")))


async def get_latencies(settings: Settings, run_ids: list[str], count: int) -> list[float]:
    from tests.app_client import app_client

    rng = random.Random(0)
    out = []
    async with app_client(settings) as api:
        for _ in range(count):
            run_id = rng.choice(run_ids)
            t = time.perf_counter()
            response = await api.get(f"/v1/runs/{run_id}")
            out.append(time.perf_counter() - t)
            response.raise_for_status()
    return out


def measure(settings: Settings, store: str, runs: int, history: int, ticks: int, gets: int) -> Row:
    backends = dataclasses.replace(open_backends(settings), launcher=ScriptedLauncher())
    try:
        scheduler = Scheduler(backends, settings)
        run_ids = [submit_run(backends, SPEC) for _ in range(runs)]
        scheduler.tick()  # StartRun: each run's topics
        now = time.time()
        for run_id in run_ids:
            give_history(backends.state, run_id, history, now)
        for _ in range(3):  # the runs' workers
            scheduler.tick()
        timings = []
        for _ in range(ticks):
            t = time.perf_counter()
            scheduler.tick()
            timings.append(time.perf_counter() - t)
        pods = len(backends.launcher.list())
        size = store_bytes(settings, backends)
    finally:
        backends.close()
    latencies = asyncio.run(get_latencies(settings, run_ids, gets))
    return Row(runs, pods, store, history, timings, size, latencies)


@contextlib.contextmanager
def postgres_server() -> Iterator[object]:
    from tests.servers import postgres as pg

    gen = pg.postgres.__wrapped__()  # type: ignore[attr-defined]
    try:
        yield next(gen)
    finally:
        gen.close()


def settings_for(home: Path, state_url: str | None) -> Settings:
    (home / "data").mkdir(parents=True)
    return Settings(home=home, state_url=state_url, data_dirs=str(home / "data"), lease_seconds=3600.0)


# Kafka's guidance (KIP-578): at most about 4,000 partition replicas a broker and 200,000 a cluster;
# KRaft raises the cluster's bound, not a broker's.
PARTITIONS_PER_BROKER = 4_000


def kafka_partitions(runs: int, max_workers: int, replication: int) -> str:
    """The partitions the runs' topics take, from the layout ``StartRun`` creates (a prompts and a
    samples topic a run, ``rollout.max_workers`` partitions each), and the brokers they need."""
    partitions = runs * 2 * max_workers
    replicas = partitions * replication
    brokers = -(-replicas // PARTITIONS_PER_BROKER)
    return (
        f"{runs} runs x 2 topics x {max_workers} partitions = {partitions} partitions; x{replication} replicas = "
        f"{replicas} partition replicas: at least {brokers} brokers at {PARTITIONS_PER_BROKER} a broker"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[10, 100], help="active runs, one size each")
    parser.add_argument("--store", choices=["sqlite", "postgresql"], nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--history", type=int, nargs="+", default=[0, 50], help="past iterations per run")
    parser.add_argument("--ticks", type=int, default=5, help="ticks timed per size")
    parser.add_argument("--gets", type=int, default=100, help="GET /v1/runs/{id} timed per size")
    parser.add_argument("--kafka", action="store_true", help="print the Kafka partitions of the runs instead")
    parser.add_argument("--max-workers", type=int, default=10, help="with --kafka: rollout.max_workers of each run")
    parser.add_argument("--replication", type=int, default=3, help="with --kafka: the topics' replication factor")
    args = parser.parse_args()
    if args.kafka:
        for runs in args.runs:
            print(kafka_partitions(runs, args.max_workers, args.replication))
        return
    print(HEADER, flush=True)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(postgres_server()) if "postgresql" in args.store else None
        for store in args.store:
            for runs in args.runs:
                for history in args.history:
                    home = Path(tempfile.mkdtemp(prefix="spotrl-scale-"))
                    try:
                        url = server.new_database() if store == "postgresql" else None  # type: ignore[union-attr]
                        settings = settings_for(home, url)
                        print(measure(settings, store, runs, history, args.ticks, args.gets), flush=True)
                    finally:
                        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
