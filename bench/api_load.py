"""Load on the REST API: `spotrl serve` under concurrent clients (a benchmark, not a test).

    .venv/bin/python bench/api_load.py [--scenario idle|no-scheduler|one-run|all]
        [--clients 50] [--seconds 60] [--runs 100] [--history 5] [--writes 0.05]
        [--mix get=0.5,cost=0.3,list=0.2] [--rate R] [--client raw|httpx] [--procs 1]
        [--trials N] [--reference] [--replicas N]
        [--token T [--auth auto|env|file|none]] [--server-env KEY=VALUE ...] [--root DIR]
        [--profile OUT.svg|OUT.json|OUT.txt [--profile-mode gil|active|all]] [--json OUT] [--keep-home]

What it does, in a fresh temporary ``--home``:

1. Setup, on a `spotrl serve --no-scheduler` (so nothing starts): POST ``--runs`` runs with a
   small valid spec, then give each a finished history written through the state store, as a
   run that trained has: ``--history`` iterations (with a trainer's metrics), a ledger entry
   per training job and two rollout workers, status SUCCEEDED. Runs that never ran read
   cheaper than real ones (no iterations, no ledger); ``--history 0`` cancels them instead.
2. The measured server on the same home, as the scenario says: ``no-scheduler`` (the API
   alone), ``idle`` (`spotrl serve` with its scheduler, no active run), ``one-run`` (the
   scheduler training one real run of the tiny model, measured once its first iteration is
   recorded: pods compete with the server for the cores, as they do on one machine).
3. ``--clients`` clients for ``--seconds`` (after ``--warmup``): closed loop, each sends its
   next request when the previous one is answered. An operation is a read (``--mix``: GET a
   run 50%, its cost 30%, the list 20% with ``?limit=20``) or, with probability ``--writes``,
   a write: POST a run, then cancel it (so the scheduler never starts it: it starts a PENDING
   run one tick before it launches pods; the script counts the written runs that got pods
   anyway, which happens when the cancel takes longer than a tick). ``--rate R`` is open loop
   instead: R operations/s on a fixed schedule (at most ``--clients`` in flight), each latency
   counted from its scheduled time, so a slow server cannot hide its queue (no coordinated
   omission).

4. With ``--reference``, the same load on ``reference_app`` in each trial: a minimal FastAPI app
   serving the three reads from the same SQLite file through plain SQLAlchemy Core (no auth, no
   response models, no cost engine), under the same uvicorn settings (``uvicorn_options``) and
   worker threads (``SPOTRL_API_THREADS``). It serves reads only, so ``--writes`` is 0 for both.
   ``--trials N`` repeats each measurement, the reference first in every other trial, and prints
   each trial, the medians, and each trial's throughput ratio (spotrl over the reference,
   measured side by side: a ratio is less noisy than either figure on a shared machine).
   ``--replicas N`` starts N servers on the same home (the first with the scheduler, as the
   scenario says, the others ``--no-scheduler``, as API replicas run behind a load balancer)
   and spreads the requests over them in turn; their CPU is summed. ``--pin`` runs each server
   on a core of its own (``taskset -c``): a Python process runs one thread at a time, and on a
   machine with a core to spare its threads hand that lock from core to core, which costs it
   about a third more CPU per request here than on one core.

It prints requests/s, p50/p90/p99 latency of reads and of writes (and of each operation),
errors (transport errors and any non-2xx but a 409 on cancel), and the CPU seconds over the
measured window of the server (/proc/<pid>/stat, all its threads, not the pods), of the load
generator (getrusage of each of its processes) and of everything else on the machine
(/proc/stat less those two: pods, or other people's work on a shared machine, which it warns
about), and the server's CPU per request answered. The default client is a minimal keep-alive HTTP/1.1 client over asyncio streams: on 2
cores httpx's AsyncClient with 50 connections cost ~1-3 ms of CPU a request (~250-490 req/s
at 100% of a core against GET /healthz), so it measured itself; ``--client httpx`` keeps it
for comparison, ``--procs`` splits the clients over processes. With 50 closed-loop clients,
Little's law makes mean latency = 50 / throughput: a p99 under 50 ms needs more than 1000
req/s; ``--rate`` asks what latency a given rate gets.

``--token`` sends ``Authorization: Bearer <token>`` and makes the started server require it:
through a tokens file of its hash (SPOTRL_TOKENS_FILE, ``services.control.api.auth``) when the
checkout has one, else through ``--token-env`` (SPOTRL_API_TOKEN). ``--server-env`` passes any
other setting. ``--root`` serves another checkout with this interpreter (e.g. ``git archive
HEAD`` unpacked: a snapshot that others' edits do not change mid-run). ``--url`` loads a
server that is already running (setup through the API only, no history, one scenario).
``--profile`` runs py-spy (``pip install py-spy``) on the server over the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose server is measured (--root changes it)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

STORED_SPEC = {
    "model": "tiny",
    "prompts": [{"prompt": "What is 2 + 3?", "answer": "5"}],
    "batch_samples": 8,
    "iterations": 2,
}
# The one run going: long enough to outlast the measurement (cancelled after it), one or two workers.
ACTIVE_SPEC = {
    "name": "api-load-active",
    "model": "tiny",
    "prompts": [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a, b in [(2, 3), (4, 5), (7, 1), (6, 6), (3, 9), (8, 2), (5, 4), (1, 7)]
    ],
    "batch_samples": 32,
    "iterations": 100000,
    "rollout": {"min_workers": 1, "max_workers": 2},
}
READS = {"get": 0.5, "cost": 0.3, "list": 0.2, "health": 0.0}  # --mix changes the weights
LIST_LIMIT = 20
# A trainer's metric keys, so stored iterations weigh what real ones do.
METRIC_KEYS = [
    "actor/loss",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/approx_kl",
    "actor/kl_ref",
    "actor/kl_coef",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "reward/mean",
    "reward/std",
    "response/length_mean",
    "perf/tokens",
    "perf/seconds",
    "perf/tokens_per_s",
    "perf/peak_memory_mb",
]


# --- the server ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(
        cls, home: Path, *, scheduler: bool, env: dict[str, str], reference: bool = False, cpu: int | None = None
    ) -> Server:
        """`spotrl serve` of the ``ROOT`` checkout (``python -m services.cli.main``, which is what the
        ``spotrl`` script runs; ROOT on PYTHONPATH, so the pods it launches run ROOT's code too), or,
        with ``reference``, this script's minimal app (``reference_app``) on the same home; with
        ``cpu``, all its threads on that core (as ``taskset -c CPU``)."""
        port = free_port()
        log_path = home / f"{'reference' if reference else 'server'}-{port}.log"
        if reference:
            command = [sys.executable, str(Path(__file__).resolve()), "--serve-reference", "--port", str(port)]
            command += ["--root", str(ROOT), "--home", str(home)]
        else:
            command = [sys.executable, "-m", "services.cli.main", "serve", "--port", str(port), "--home", str(home)]
            if not scheduler:
                command.append("--no-scheduler")
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": pythonpath, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=None if cpu is None else lambda: os.sched_setaffinity(0, {cpu}),
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(
                    f"{command[2]} exited with {proc.returncode}; see {log_path}:\n{log_path.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{server.url}/healthz", timeout=1, trust_env=False).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        server.stop()
        raise SystemExit(f"{command[2]} did not answer /healthz within 60 s; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn shuts down cleanly; the scheduler releases its lease
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_replicas(
    home: Path, *, scheduler: bool, env: dict[str, str], replicas: int, reference: bool, pin: bool
) -> list[Server]:
    """``replicas`` servers on the same home, each on its port: the first as the scenario says, the
    others `spotrl serve --no-scheduler` (one scheduler leads anyway: the lease), as API replicas
    run beside one scheduler behind a load balancer (the clients spread their requests over them);
    with ``pin``, each on a core of its own (the last cores first: the load generator starts on core 0)."""
    cores = sorted(os.sched_getaffinity(0), reverse=True)
    servers: list[Server] = []
    try:
        for i in range(replicas):
            cpu = cores[i % len(cores)] if pin else None
            servers.append(Server.start(home, scheduler=scheduler and i == 0, env=env, reference=reference, cpu=cpu))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children: pods are their own processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle (every process on the machine)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (
        sum(values[i] for i in (0, 1, 2, 5, 6, 7)) / CLOCK_TICKS
    )  # user nice system irq softirq steal (not idle, iowait)


# --- setup ----------------------------------------------------------------------------------
def auth_env(args: argparse.Namespace, home: Path) -> dict[str, str]:
    """The server's environment that makes it require ``--token``."""
    if not args.token or args.auth == "none":
        return {}
    mode = args.auth
    if mode == "auto":
        mode = "file" if (ROOT / "services" / "api" / "auth.py").exists() else "env"
    if mode == "env":
        return {args.token_env: args.token}
    # The tokens file of services.control.api.auth: hashes only, each with its tenant.
    path = home / "tokens.json"
    entry = {
        "sha256": hashlib.sha256(args.token.encode()).hexdigest(),
        "tenant": args.tenant,
        "admin": False,
        "label": "api_load",
    }
    path.write_text(json.dumps({"tokens": [entry]}))
    return {"SPOTRL_TOKENS_FILE": str(path)}


def headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def runs_of(body: object) -> list:
    """The runs of a list response: ``{"runs": [...], ...}`` or a bare list."""
    return body["runs"] if isinstance(body, dict) else body  # type: ignore[index]


async def store_runs(url: str, token: str | None, count: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, headers=headers(token), timeout=60, trust_env=False) as client:
        limit = asyncio.Semaphore(8)

        async def one(i: int) -> str:
            async with limit:
                r = await client.post("/v1/runs", json={**STORED_SPEC, "name": f"stored-{i}"})
                if r.status_code != 201:
                    raise SystemExit(f"POST /v1/runs answered {r.status_code}: {r.text[:500]}")
                return r.json()["id"]

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def give_history(home: Path, run_ids: list[str], iterations: int) -> None:
    """Make each stored run one that trained and succeeded, through the state store (the server's
    own code, on its SQLite file): ``iterations`` iterations, a ledger entry per training job and
    two rollout workers."""
    sys.path.insert(0, str(ROOT))
    from contracts.status import RunStatus
    from services.core.config import Settings
    from services.ports.state.state_store import StateStore
    from tests.iteration_rows import past_training_job

    os.environ["SPOTRL_HOME"] = str(home)
    state = StateStore(Settings().resolved_state_url())
    rng = random.Random(0)
    now = time.time()
    try:
        for run_id in run_ids:
            state.set_status(run_id, RunStatus.RUNNING)
            t = now - 40.0 * iterations - 60.0
            for slot in range(2):
                state.open_ledger(
                    run_id=run_id,
                    role="rollout",
                    pod=f"{run_id}-rollout-{slot}",
                    instance_type="g6.xlarge",
                    capacity_type="spot",
                    price_per_hour=0.35,
                    price_source="api_load (seeded)",
                    started_at=t,
                )
            for i in range(1, iterations + 1):
                past_training_job(
                    state,
                    run_id,
                    i,
                    t + 30.0,
                    10.0,
                    price_source="api_load (seeded)",
                    mean_reward=rng.random(),
                    kl=rng.random() / 10,
                    loss=rng.random(),
                    metrics={k: rng.random() for k in METRIC_KEYS},
                )
                t += 40.0
            for slot in range(2):
                state.close_ledger(f"{run_id}-rollout-{slot}", ended_at=t)
            state.begin_ending(run_id, RunStatus.SUCCEEDED, f"trained {iterations} iterations")
            state.set_status(run_id, RunStatus.SUCCEEDED, f"trained {iterations} iterations")
    finally:
        state.close()


def cancel_all(url: str, token: str | None, run_ids: list[str]) -> None:
    with httpx.Client(base_url=url, headers=headers(token), timeout=60, trust_env=False) as client:
        for run_id in run_ids:
            client.post(f"/v1/runs/{run_id}/cancel").raise_for_status()


def start_active_run(url: str, token: str | None, timeout_s: float) -> str:
    """Submit the one run going and wait for its first iteration (pods up, training)."""
    with httpx.Client(base_url=url, headers=headers(token), timeout=60, trust_env=False) as client:
        r = client.post("/v1/runs", json=ACTIVE_SPEC)
        r.raise_for_status()
        run_id = r.json()["id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = client.get(f"/v1/runs/{run_id}").json()
            if run["iterations"]:
                return run_id
            if run["status"] not in ("PENDING", "RUNNING"):
                raise SystemExit(
                    f"the active run {run_id} is {run['status']}: {run.get('status_reason')} {run.get('last_error')}"
                )
            time.sleep(1.0)
        raise SystemExit(f"the active run {run_id} recorded no iteration within {timeout_s:.0f} s")


def end_active_run(url: str, token: str | None, run_id: str, home: Path | None) -> None:
    """Cancel the run and wait until its pods are gone; stop any that outlast that."""
    with httpx.Client(base_url=url, headers=headers(token), timeout=60, trust_env=False) as client:
        client.post(f"/v1/runs/{run_id}/cancel")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if client.get(f"/v1/runs/{run_id}").json()["status"] == "CANCELLED":
                return
            time.sleep(1.0)
    print(f"warning: run {run_id} not CANCELLED within 90 s; stopping its pods", file=sys.stderr)
    if home is not None:
        stop_pods(home)


def stop_pods(home: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from services.ports.launcher.local_launcher import LocalLauncher

    launcher = LocalLauncher(home / "pods")
    for pod in launcher.list():
        launcher.stop(pod.name, grace_s=5)


def count_in_store(home: Path, query: str, params: list[str] | tuple = ()) -> int | None:
    """A count from the embedded state store's file; None when the server keeps it elsewhere."""
    try:
        with sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True) as db:
            return db.execute(query, params).fetchone()[0]
    except sqlite3.Error:
        return None


def pods_of(home: Path, run_ids: set[str]) -> int | None:
    """Ledger entries (pods launched) of the given runs."""
    if not run_ids:
        return 0
    marks = ",".join("?" * len(run_ids))
    return count_in_store(home, f"SELECT count(*) FROM ledger WHERE run_id IN ({marks})", sorted(run_ids))


# --- the reference: a minimal FastAPI app over the same store --------------------------------
def reference_app(state_url: str, threads: int) -> object:
    """What the three reads cost with nothing of spotrl's: a minimal FastAPI app that serves them
    from the state store's file through plain SQLAlchemy Core (tables reflected from the file,
    statements built once, sync routes in ``threads`` worker threads as `spotrl serve` has), dicts
    for responses: no auth, no response models, no cost engine (spent summed in SQL, without the
    providers' billing rules)."""
    from contextlib import asynccontextmanager

    import anyio.to_thread
    from fastapi import FastAPI, HTTPException
    from sqlalchemy import MetaData, bindparam, create_engine, func, select

    engine = create_engine(state_url)
    meta = MetaData()
    meta.reflect(engine, only=["runs", "iterations", "ledger"])
    runs, iterations, ledger = meta.tables["runs"], meta.tables["iterations"], meta.tables["ledger"]
    spent = func.coalesce(
        func.sum(
            (func.coalesce(ledger.c.ended_at, bindparam("now")) - ledger.c.started_at)
            * ledger.c.price_per_hour
            / 3600.0
        ),
        0.0,
    )
    of_run = ledger.c.run_id == bindparam("run_id")
    page = (
        select(*[c for c in runs.c if c.name != "spec"])
        .order_by(runs.c.created_at, runs.c.id)
        .limit(bindparam("limit"))
    )
    spent_by_run = select(ledger.c.run_id, spent).where(ledger.c.run_id.in_(bindparam("ids", expanding=True)))
    run = select(runs).where(runs.c.id == bindparam("run_id"))
    latest = (
        select(iterations)
        .where(iterations.c.run_id == bindparam("run_id"))
        .order_by(iterations.c.iteration.desc())
        .limit(100)
    )
    run_spent = select(spent).where(of_run)
    exists = select(runs.c.id).where(runs.c.id == bindparam("run_id"))
    entries = select(ledger).where(of_run).order_by(ledger.c.id).limit(100)
    by_role = select(ledger.c.role, spent).where(of_run).group_by(ledger.c.role)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/runs")
    def list_runs(limit: int = 50) -> dict:
        with engine.connect() as conn:
            rows = conn.execute(page, {"limit": limit}).mappings().all()
            ids = [r["id"] for r in rows]
            dollars = dict(conn.execute(spent_by_run.group_by(ledger.c.run_id), {"ids": ids, "now": time.time()}).all())
        return {"runs": [{**r, "spent_dollars": dollars.get(r["id"], 0.0)} for r in rows], "next_cursor": None}

    @app.get("/v1/runs/{run_id}")
    def get_run(run_id: str) -> dict:
        with engine.connect() as conn:
            row = conn.execute(run, {"run_id": run_id}).mappings().first()
            if row is None:
                raise HTTPException(404)
            shown = [dict(it) for it in reversed(conn.execute(latest, {"run_id": run_id}).mappings().all())]
            dollars = conn.execute(run_spent, {"run_id": run_id, "now": time.time()}).scalar()
        return {**row, "iterations": shown, "spent_dollars": dollars}

    @app.get("/v1/runs/{run_id}/cost")
    def run_cost(run_id: str) -> dict:
        with engine.connect() as conn:
            if conn.execute(exists, {"run_id": run_id}).first() is None:
                raise HTTPException(404)
            shown = [dict(e) for e in conn.execute(entries, {"run_id": run_id}).mappings().all()]
            roles = dict(conn.execute(by_role, {"run_id": run_id, "now": time.time()}).all())
        return {"run_id": run_id, "total_dollars": sum(roles.values()), "by_role": roles, "entries": shown}

    return app


def serve_reference(port: int, home: Path) -> None:
    """Run ``reference_app`` as `spotrl serve` runs its app: the same uvicorn settings and logging."""
    sys.path.insert(0, str(ROOT))
    import logging

    import uvicorn

    from services.control.api.http_server import uvicorn_options
    from services.core.config import Settings

    os.environ["SPOTRL_HOME"] = str(home)
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = reference_app(settings.resolved_state_url(), settings.api_threads)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info", **uvicorn_options(settings))  # type: ignore[arg-type]


# --- the load -------------------------------------------------------------------------------
@dataclass
class Load:
    """What one load process is to do; picklable for --procs."""

    urls: list[str]  # the server's, or its replicas' (requests spread over them in turn)
    token: str | None
    clients: int
    start_at: float  # time.time() of the end of warm-up (same clock in every process)
    warmup: float
    seconds: float
    writes: float
    rate: float | None  # operations/s of this process (open loop), or None (closed loop)
    run_ids: list[str]
    seed: int
    mix: dict[str, float]  # read -> weight
    client: str  # a key of CLIENTS


@dataclass
class Result:
    latencies: dict[str, list[float]] = field(default_factory=dict)  # op -> seconds
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # op -> status (or exception name) -> count
    created: list[str] = field(default_factory=list)
    completed_in_window: int = 0  # responses that arrived within the window (what the server achieved)
    cpu_seconds: float = 0.0

    def merge(self, other: Result) -> None:
        for op, values in other.latencies.items():
            self.latencies.setdefault(op, []).extend(values)
        for op, counts in other.statuses.items():
            mine = self.statuses.setdefault(op, {})
            for status, n in counts.items():
                mine[status] = mine.get(status, 0) + n
        self.created.extend(other.created)
        self.completed_in_window += other.completed_in_window
        self.cpu_seconds += other.cpu_seconds


OP_PATHS = {
    "get": "/v1/runs/{id}",
    "cost": "/v1/runs/{id}/cost",
    "list": f"/v1/runs?limit={LIST_LIMIT}",
    "health": "/healthz",  # the framework's floor: no store, no auth
}
WRITE_OPS = ("create", "cancel")
EXPECTED = {"create": {201}, "cancel": {200, 409}, "get": {200}, "cost": {200}, "list": {200}, "health": {200}}


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams: one connection per request in
    flight, reused. It costs the generator ~60 us of CPU a request where httpx's AsyncClient
    costs ~1-3 ms with 50 connections (measured on this 2-core machine against GET /healthz), so
    the figures are the server's, not the generator's."""

    def __init__(self, url: str, size: int, extra_headers: dict[str, str], timeout: float) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port or 80
        self.head = f"host: {self.host}:{self.port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in extra_headers.items())
        self.timeout = timeout
        # (reader, writer, last used); LIFO, so that few connections stay hot at a low rate
        self.free: asyncio.LifoQueue[tuple[asyncio.StreamReader, asyncio.StreamWriter, float] | None] = (
            asyncio.LifoQueue()
        )
        for _ in range(size):
            self.free.put_nowait(None)  # connected on first use

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = await self.free.get()
        try:
            async with asyncio.timeout(self.timeout):
                if conn is not None and time.monotonic() - conn[2] > KEEPALIVE_REUSE_S:
                    conn[1].close()  # the server may be closing it: uvicorn drops a connection idle 5 s
                    conn = None
                if conn is None:
                    conn = (*await asyncio.open_connection(self.host, self.port), 0.0)
                reader, writer, _ = conn
                head = f"{method} {path} HTTP/1.1\r\n{self.head}"
                if body is not None:
                    head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                writer.write(head.encode() + b"\r\n" + (body or b""))
                lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
                status = int(lines[0].split(None, 2)[1])
                fields = {}
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    fields[name.strip().lower()] = value.strip().lower()
                if fields.get(b"transfer-encoding") == b"chunked":
                    chunks = []
                    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                        chunks.append((await reader.readexactly(size + 2))[:-2])
                    await reader.readuntil(b"\r\n")  # no trailers from uvicorn
                    data = b"".join(chunks)
                else:
                    data = await reader.readexactly(int(fields.get(b"content-length", b"0")))
                if fields.get(b"connection") == b"close":
                    writer.close()
                    conn = None
                else:
                    conn = (reader, writer, time.monotonic())
                return status, data
        except BaseException:
            if conn is not None:
                conn[1].close()
                conn = None
            raise
        finally:
            self.free.put_nowait(conn)

    async def close(self) -> None:
        while not self.free.empty():
            conn = self.free.get_nowait()
            if conn is not None:
                conn[1].close()


class HttpxHTTP:
    """The same through one httpx.AsyncClient with keep-alive (``--client httpx``)."""

    def __init__(self, url: str, size: int, extra_headers: dict[str, str], timeout: float) -> None:
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.client = httpx.AsyncClient(
            base_url=url, headers=extra_headers, limits=limits, timeout=timeout, trust_env=False
        )

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        extra = {"content": body, "headers": {"content-type": "application/json"}} if body is not None else {}
        response = await self.client.request(method, path, **extra)
        return response.status_code, response.content

    async def close(self) -> None:
        await self.client.aclose()


CLIENTS = {"raw": RawHTTP, "httpx": HttpxHTTP}


class Spread:
    """Requests to several replicas in turn, each with its own connections (a load balancer's work)."""

    def __init__(self, clients: list[RawHTTP | HttpxHTTP]) -> None:
        self.clients = clients
        self.turn = 0

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.turn = (self.turn + 1) % len(self.clients)
        return await self.clients[self.turn].request(method, path, body)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


KEEPALIVE_REUSE_S = 2.0  # reconnect rather than reuse a connection idle longer (uvicorn's keep-alive timeout is 5 s)
TRANSPORT_ERRORS = (
    OSError,
    EOFError,
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
    TimeoutError,
    ValueError,
    httpx.HTTPError,
)


async def run_load(load: Load) -> Result:
    result = Result()
    # Each replica gets connections enough for every client (a client's next request may go to any).
    http = Spread([CLIENTS[load.client](url, load.clients, headers(load.token), 30.0) for url in load.urls])
    try:
        measure_from = load.start_at
        measure_to = load.start_at + load.seconds

        def record(op: str, status: str, started: float, ended: float) -> None:
            now = time.time()
            if measure_from <= now - (time.perf_counter() - ended) < measure_to:
                result.completed_in_window += 1
            wall = now - (time.perf_counter() - started)  # when it started, on the shared clock
            if measure_from <= wall < measure_to:
                result.latencies.setdefault(op, []).append(ended - started)
                counts = result.statuses.setdefault(op, {})
                counts[status] = counts.get(status, 0) + 1

        async def request(
            op: str, method: str, path: str, scheduled: float | None = None, body: bytes | None = None
        ) -> tuple[int, bytes] | None:
            started = time.perf_counter() if scheduled is None else scheduled
            try:
                status, data = await http.request(method, path, body)
            except TRANSPORT_ERRORS as e:
                record(op, type(e).__name__, started, time.perf_counter())
                return None
            record(op, str(status), started, time.perf_counter())
            return status, data

        write_body = json.dumps({**STORED_SPEC, "name": "load-write"}).encode()

        async def operation(rng: random.Random, scheduled: float | None = None) -> None:
            if rng.random() < load.writes:
                r = await request("create", "POST", "/v1/runs", scheduled, write_body)
                if r is not None and r[0] == 201:
                    run_id = json.loads(r[1])["id"]
                    result.created.append(run_id)
                    await request("cancel", "POST", f"/v1/runs/{run_id}/cancel", None, b"")
                return
            op = rng.choices(list(load.mix), weights=list(load.mix.values()))[0]
            await request(op, "GET", OP_PATHS[op].format(id=rng.choice(load.run_ids)), scheduled)

        warm_from = load.start_at - load.warmup
        await asyncio.sleep(max(0.0, warm_from - time.time()))
        end = time.perf_counter() + (measure_to - time.time())
        usage_before = None

        async def cpu_window() -> None:
            nonlocal usage_before
            await asyncio.sleep(max(0.0, measure_from - time.time()))
            usage_before = resource.getrusage(resource.RUSAGE_SELF)

        window = asyncio.create_task(cpu_window())
        if load.rate is None:

            async def closed_loop(i: int) -> None:
                rng = random.Random(load.seed * 1000 + i)
                while time.perf_counter() < end:
                    await operation(rng)

            await asyncio.gather(*(closed_loop(i) for i in range(load.clients)))
        else:
            rng = random.Random(load.seed)
            in_flight = asyncio.Semaphore(load.clients)
            tasks = set()

            async def scheduled_op(at: float) -> None:
                async with in_flight:
                    await operation(rng, scheduled=at)

            next_at = time.perf_counter()
            while next_at < end:
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                task = asyncio.create_task(scheduled_op(next_at))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += 1.0 / load.rate
            await asyncio.gather(*tasks)
        usage_after = resource.getrusage(resource.RUSAGE_SELF)
        await window
        assert usage_before is not None
        result.cpu_seconds = (usage_after.ru_utime + usage_after.ru_stime) - (
            usage_before.ru_utime + usage_before.ru_stime
        )
    finally:
        await http.close()
    return result


def load_process(load: Load, out: mp.Queue) -> None:
    out.put(asyncio.run(run_load(load)))


def run_loads(loads: list[Load]) -> Result:
    if len(loads) == 1:
        return asyncio.run(run_load(loads[0]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=load_process, args=(load, out)) for load in loads]
    for p in procs:
        p.start()
    total = Result()
    for _ in procs:
        total.merge(out.get())
    for p in procs:
        p.join()
    return total


# --- figures --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def latency_summary(values: list[float]) -> dict:
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "count": len(values),
        "p50_ms": ms(percentile(values, 50)),
        "p90_ms": ms(percentile(values, 90)),
        "p99_ms": ms(percentile(values, 99)),
        "max_ms": ms(max(values) if values else None),
    }


def figures(result: Result, *, seconds: float) -> dict:
    reads = [v for op in READS for v in result.latencies.get(op, [])]
    writes = [v for op in WRITE_OPS for v in result.latencies.get(op, [])]
    errors: dict[str, int] = {}
    expected: dict[str, int] = {}
    for op, counts in result.statuses.items():
        for status, n in counts.items():
            ok = status.isdigit() and int(status) in EXPECTED[op]
            if ok and not status.startswith("2"):
                expected[f"{op} {status}"] = n
            elif not ok:
                errors[f"{op} {status}"] = n
    total = len(reads) + len(writes)
    return {
        "requests": total,  # started in the window (the offered load, with --rate)
        "requests_per_s": round(total / seconds, 1),
        "completed_per_s": round(result.completed_in_window / seconds, 1),
        "reads": latency_summary(reads),
        "writes": latency_summary(writes),
        "by_op": {op: latency_summary(result.latencies.get(op, [])) for op in (*READS, *WRITE_OPS)},
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "expected_non_2xx": expected,
    }


def fmt_latency(name: str, s: dict) -> str:
    if not s["count"]:
        return f"  {name:<7} (none)"
    return (
        f"  {name:<7} {s['count']:>7}  p50 {s['p50_ms']:8.1f} ms  p90 {s['p90_ms']:8.1f} ms  "
        f"p99 {s['p99_ms']:8.1f} ms  max {s['max_ms']:8.1f} ms"
    )


def print_report(fig: dict) -> None:
    print(f"\n== {fig['scenario']}: {fig['description']}")
    if fig["rate"] is None:
        print(f"  {fig['requests']} requests in {fig['seconds']:.0f} s = {fig['requests_per_s']} req/s")
    else:
        print(
            f"  open loop, {fig['rate']:g} operations/s: {fig['requests']} requests scheduled in {fig['seconds']:.0f} s "
            f"({fig['requests_per_s']} req/s offered), {fig['completed_per_s']} req/s answered within it"
        )
    print(fmt_latency("reads", fig["reads"]))
    print(fmt_latency("writes", fig["writes"]))
    for op, s in fig["by_op"].items():
        if s["count"]:
            print(fmt_latency(op, s))
    print(
        f"  errors: {fig['errors']}"
        + (f" {fig['errors_by_kind']}" if fig["errors"] else "")
        + (f"  (expected: {fig['expected_non_2xx']})" if fig["expected_non_2xx"] else "")
    )
    cpu = fig["cpu_seconds"]
    cores = os.cpu_count() or 1
    span = fig["seconds"]
    share = lambda s: "n/a" if s is None else f"{s:.1f} s ({100 * s / span:.0f}% of a core)"  # noqa: E731
    print(
        f"  CPU over {span:.0f} s on {cores} cores ({cores * span:.0f} core-s): server {share(cpu['server'])}, "
        f"load generator {share(cpu['load_generator'])} ({fig['client']} client, {fig['procs']} process(es)), "
        f"everything else {share(cpu['other'])} (machine busy {cpu['machine']:.1f} s)"
    )
    if fig["server_ms_per_request"] is not None:
        print(f"  server CPU per request: {fig['server_ms_per_request']:.2f} ms")
    if cpu["other"] is not None and cpu["other"] > 0.1 * span and fig["scenario"] != "one-run":
        print(
            f"  warning: other processes took {cpu['other']:.1f} CPU seconds during the window (pods, or someone else's work "
            "on this machine): the server had less than the machine"
        )
    print(
        f"  list ?limit={LIST_LIMIT} honoured: {fig['list_limit_honoured']}; runs in the store at the end: {fig['runs_at_end']}; "
        f"written runs that got pods: {fig['written_runs_with_pods']}"
    )


def print_summary(name: str, pairs: list[tuple[dict, dict | None]]) -> None:
    """Each trial's throughput, server CPU per request and reads p99, and their medians; with the
    reference, each trial's throughput ratio (its server over the reference's, measured side by side)."""
    with_reference = pairs[0][1] is not None
    print(
        f"\n== {name}: {len(pairs)} trial(s)"
        + (", alternating with the reference (reads only)" if with_reference else "")
    )

    def columns(fig: dict) -> str:
        ms = fig["server_ms_per_request"]
        return (
            f"{fig['completed_per_s']:>8.1f} req/s {'n/a' if ms is None else f'{ms:5.2f}':>5} ms CPU/req "
            f"p99 {fig['reads']['p99_ms'] or 0:7.1f} ms"
        )

    ratios = []
    for i, (fig, ref) in enumerate(pairs, start=1):
        line = f"  trial {i}: spotrl {columns(fig)}"
        if ref is not None:
            ratios.append(fig["completed_per_s"] / ref["completed_per_s"] if ref["completed_per_s"] else 0.0)
            line += f" | reference {columns(ref)} | ratio {ratios[-1]:.2f}"
        print(line)
    median = statistics.median

    def middle(figs: list[dict]) -> dict:
        cpu = [f["server_ms_per_request"] for f in figs if f["server_ms_per_request"] is not None]
        return {
            "completed_per_s": median(f["completed_per_s"] for f in figs),
            "server_ms_per_request": median(cpu) if cpu else None,
            "reads": {"p99_ms": median(f["reads"]["p99_ms"] or 0 for f in figs)},
        }

    line = f"  median:  spotrl {columns(middle([f for f, _ in pairs]))}"
    if with_reference:
        line += f" | reference {columns(middle([r for _, r in pairs if r is not None]))} | ratio {median(ratios):.2f}"
    print(line)


# --- scenarios ------------------------------------------------------------------------------
SCENARIOS = {
    "no-scheduler": (False, False, "`spotrl serve --no-scheduler`: the API alone"),
    "idle": (True, False, "`spotrl serve` with its scheduler, no active run"),
    "one-run": (True, True, "`spotrl serve` with its scheduler training one run of the tiny model"),
}


def probe(url: str, token: str | None, run_ids: list[str]) -> tuple[bool | None, int]:
    """Whether the list honours ?limit= (None: too few runs to tell), and how many runs the list
    shows; checks that auth is on when a token is set."""
    with httpx.Client(base_url=url, headers=headers(token), timeout=60, trust_env=False) as client:
        limited = runs_of(client.get(f"/v1/runs?limit={LIST_LIMIT}").raise_for_status().json())
        everything = runs_of(client.get("/v1/runs").raise_for_status().json())
        if token:
            anonymous = httpx.get(f"{url}/v1/runs/{run_ids[0]}", timeout=60, trust_env=False)
            if anonymous.status_code != 401:
                print(f"warning: a request without the token got {anonymous.status_code}, not 401", file=sys.stderr)
    return (len(limited) <= LIST_LIMIT if len(everything) > LIST_LIMIT else None), len(everything)


PROFILE_MODES = {"gil": ["--gil"], "active": [], "all": ["--idle"]}


def run_scenario(
    name: str,
    args: argparse.Namespace,
    home: Path | None,
    run_ids: list[str],
    server_env: dict[str, str],
    *,
    reference: bool = False,
) -> dict:
    """One measured window of the scenario ``name`` on ``args.replicas`` servers (``reference``:
    of the minimal app instead, beside the scenario's scheduler-less counterpart)."""
    scheduler, active, description = SCENARIOS[name]
    if reference:
        scheduler, active, description = False, False, "the reference: a minimal FastAPI app, plain SQLAlchemy"
    servers: list[Server] = []
    active_id = None
    if args.url:
        urls = [args.url]
        pids = [args.server_pid] if args.server_pid else []
    else:
        assert home is not None
        servers = start_replicas(
            home, scheduler=scheduler, env=server_env, replicas=args.replicas, reference=reference, pin=args.pin
        )
        urls, pids = [s.url for s in servers], [s.proc.pid for s in servers]
    if len(urls) > 1:
        description += f", {len(urls)} replicas"
    if args.pin and not args.url:
        description += ", each pinned to a core"
    url, pid = urls[0], (pids[0] if pids else None)
    profiler = None
    try:
        if active:
            print(f"[{name}] starting the active run, waiting for its first iteration ...", flush=True)
            active_id = start_active_run(url, args.token, args.active_timeout)
        targets = run_ids + ([active_id] if active_id else [])
        honoured, _ = probe(url, None if reference else args.token, targets)
        label = "reference" if reference else name
        print(f"[{label}] {args.clients} clients, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s ...", flush=True)
        start_at = time.time() + 1.0 + args.warmup
        per_proc_clients = [args.clients // args.procs + (i < args.clients % args.procs) for i in range(args.procs)]
        loads = [
            Load(
                urls=urls,
                token=args.token,
                clients=c,
                start_at=start_at,
                warmup=args.warmup,
                seconds=args.seconds,
                writes=args.writes,
                rate=None if args.rate is None else args.rate / args.procs,
                run_ids=targets,
                seed=args.seed + i,
                mix=args.mix,
                client=args.client,
            )
            for i, c in enumerate(per_proc_clients)
        ]
        profile_command = None
        if args.profile and pid:
            profile_path = Path(args.profile)
            if args.scenario == "all":
                profile_path = profile_path.with_name(f"{profile_path.stem}-{name}{profile_path.suffix}")
            fmt = {".svg": "flamegraph", ".json": "speedscope", ".txt": "raw"}.get(profile_path.suffix, "flamegraph")
            py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
            profile_command = [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(args.seconds)),
                "--format",
                fmt,
                "--output",
                str(profile_path),
                "--nonblocking",
                "--threads",
                *PROFILE_MODES[args.profile_mode],
            ]
        cpu_before = cpu_after = None

        def sample_cpu() -> tuple[float | None, float]:
            return (sum(proc_cpu_seconds(p) for p in pids) if pids else None), machine_busy_seconds()

        # The server's and machine's CPU are read at the edges of the window by a helper thread.

        def edges() -> None:
            nonlocal cpu_before, cpu_after, profiler
            time.sleep(max(0.0, start_at - time.time()))
            cpu_before = sample_cpu()
            if profile_command:  # sampling over the measured window only
                profiler = subprocess.Popen(profile_command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(max(0.0, start_at + args.seconds - time.time()))
            cpu_after = sample_cpu()

        edge_thread = threading.Thread(target=edges, daemon=True)
        edge_thread.start()
        result = run_loads(loads)
        edge_thread.join()
        if profiler is not None:
            _, err = profiler.communicate(timeout=120)
            if profiler.returncode:
                print(f"warning: py-spy failed: {err.decode()[-500:]}", file=sys.stderr)
        fig = figures(result, seconds=args.seconds)
        assert cpu_before is not None and cpu_after is not None
        server_cpu = None if cpu_before[0] is None else cpu_after[0] - cpu_before[0]  # type: ignore[operator]
        _, runs_at_end = probe(url, None if reference else args.token, targets)
        if home is not None:  # the list may be paginated: count in the store itself
            runs_at_end = count_in_store(home, "SELECT count(*) FROM runs") or runs_at_end
        fig.update(
            scenario="reference" if reference else name,
            description=description + (f" ({active_id})" if active_id else ""),
            replicas=len(urls),
            server_ms_per_request=None
            if server_cpu is None or not result.completed_in_window
            else round(1000 * server_cpu / result.completed_in_window, 3),
            seconds=args.seconds,
            clients=args.clients,
            rate=args.rate,
            procs=args.procs,
            client=args.client,
            writes_fraction=args.writes,
            mix=args.mix,
            stored_runs=len(run_ids),
            history_iterations=args.history,
            cpu_seconds={
                "server": None if server_cpu is None else round(server_cpu, 2),
                "load_generator": round(result.cpu_seconds, 2),
                "machine": round(cpu_after[1] - cpu_before[1], 2),
                # pods and anything else running on the machine
                "other": None
                if server_cpu is None
                else round(cpu_after[1] - cpu_before[1] - server_cpu - result.cpu_seconds, 2),
            },
            cores=os.cpu_count(),
            list_limit_honoured=honoured,
            runs_at_end=runs_at_end,
            written_runs=len(result.created),
            written_runs_with_pods=pods_of(home, set(result.created)) if home else None,
        )
        return fig
    finally:
        if profiler is not None and profiler.poll() is None:
            profiler.kill()
        if active_id:
            end_active_run(url, args.token, active_id, home)
        for server in servers:
            server.stop()


def parse_mix(text: str) -> dict[str, float]:
    mix = dict.fromkeys(READS, 0.0)
    for part in text.split(","):
        op, _, weight = part.partition("=")
        if op not in mix:
            raise argparse.ArgumentTypeError(f"unknown read {op!r}: one of {', '.join(READS)}")
        mix[op] = float(weight or 1)
    if not any(mix.values()):
        raise argparse.ArgumentTypeError("give some read a weight above 0")
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="idle")
    parser.add_argument(
        "--clients", type=int, default=50, help="Concurrent clients (closed loop), or the most in flight with --rate."
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="Measured seconds.")
    parser.add_argument("--warmup", type=float, default=3.0, help="Seconds of load before the measured window.")
    parser.add_argument("--runs", type=int, default=100, help="Runs stored before the load.")
    parser.add_argument(
        "--history",
        type=int,
        default=5,
        help="Iterations of each stored run (0: stored runs are cancelled, never ran).",
    )
    parser.add_argument(
        "--writes",
        type=float,
        default=0.05,
        help="Fraction of operations that are writes (POST a run, then cancel it).",
    )
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=dict(READS),
        metavar="OP=W,...",
        help="Weights of the reads: get, cost, list, health (GET /healthz); default get=0.5,cost=0.3,list=0.2.",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="Open loop: operations per second on a fixed schedule."
    )
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="raw: a minimal keep-alive HTTP/1.1 client (~60 us CPU a request); httpx: one httpx.AsyncClient (~1-3 ms a request).",
    )
    parser.add_argument("--procs", type=int, default=1, help="Load generator processes (the clients split among them).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default=None, help="Send `Authorization: Bearer <token>`.")
    parser.add_argument(
        "--auth",
        choices=["auto", "env", "file", "none"],
        default="auto",
        help="How the started server learns --token: env (SPOTRL_API_TOKEN, or --token-env), file (a tokens file of its "
        "sha256 for --tenant, SPOTRL_TOKENS_FILE), none; auto: file when the checkout has services/control/api/auth.py.",
    )
    parser.add_argument(
        "--token-env", default="SPOTRL_API_TOKEN", help="The setting that holds the token, with --auth env."
    )
    parser.add_argument("--tenant", default="load", help="The token's tenant, with --auth file.")
    parser.add_argument(
        "--root", default=None, help="Serve another checkout (e.g. `git archive HEAD` unpacked) with this venv."
    )
    parser.add_argument(
        "--server-env", action="append", default=[], metavar="KEY=VALUE", help="Environment of the server (repeatable)."
    )
    parser.add_argument(
        "--active-timeout", type=float, default=300.0, help="Seconds to wait for the active run's first iteration."
    )
    parser.add_argument(
        "--url", default=None, help="Load a running server instead of starting one (no history, one scenario)."
    )
    parser.add_argument(
        "--server-pid", type=int, default=None, help="With --url: the server's pid, for its CPU seconds."
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="py-spy record the server over the window: .svg flamegraph, .json speedscope, .txt collapsed stacks.",
    )
    parser.add_argument(
        "--profile-mode",
        choices=list(PROFILE_MODES),
        default="gil",
        help="gil: samples of the thread holding the GIL only (where the server's Python CPU goes); active: every thread "
        "not idle (also threads waiting for the GIL or a lock: where requests wait); all: idle threads too.",
    )
    parser.add_argument(
        "--trials", type=int, default=1, help="Measured windows of each scenario (with --reference: alternating)."
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="Also measure the minimal FastAPI app (reference_app) on the same store, in each trial, alternating "
        "with the scenario's server; reads only (--writes 0 for both).",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="Server processes on the same store, the clients' requests spread over them in turn (the first runs "
        "the scheduler, as the scenario says; the others `--no-scheduler`).",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="Run each server (replica) with all its threads on one core of its own (as `taskset -c`): one Python "
        "process holds one lock to run, and its threads handing it between cores cost more than they do on one.",
    )
    parser.add_argument("--serve-reference", action="store_true", help=argparse.SUPPRESS)  # reference_app's process
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--home", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, metavar="OUT", help="Write the figures of every scenario to OUT.")
    parser.add_argument("--keep-home", action="store_true", help="Keep the temporary --home (server logs, state.db).")
    args = parser.parse_args()
    global ROOT
    if args.root:
        ROOT = Path(args.root).resolve()
    if args.serve_reference:
        serve_reference(args.port, Path(args.home))
        return
    if args.url and (args.scenario == "all" or args.reference or args.replicas != 1):
        parser.error("--url loads one running server: give the --scenario it is in (no --reference, no --replicas)")
    if args.reference and args.writes:
        print("the reference serves reads only: --writes 0 for both", flush=True)
        args.writes = 0.0
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]

    home = None if args.url else Path(tempfile.mkdtemp(prefix="spotrl-api-load-"))
    server_env = {**(auth_env(args, home) if home else {}), **dict(kv.split("=", 1) for kv in args.server_env)}
    reports = []
    try:
        if args.url:
            run_ids = asyncio.run(store_runs(args.url, args.token, args.runs))
            args.history = 0
        else:
            assert home is not None
            print(f"setup: {args.runs} runs in {home} (history {args.history} iterations each) ...", flush=True)
            setup = Server.start(home, scheduler=False, env=server_env)
            try:
                run_ids = asyncio.run(store_runs(setup.url, args.token, args.runs))
                if args.history:
                    give_history(home, run_ids, args.history)
                else:
                    cancel_all(setup.url, args.token, run_ids)
            finally:
                setup.stop()
        for name in names:
            pairs = []
            for trial in range(args.trials):
                # The reference goes second in even trials and first in odd ones: drift in the
                # machine's other load falls on both alike.
                order = [False, True] if args.reference else [False]
                figs = {}
                for reference in order if trial % 2 == 0 else order[::-1]:
                    fig = run_scenario(name, args, home, run_ids, server_env, reference=reference)
                    fig["trial"] = trial + 1
                    print_report(fig)
                    reports.append(fig)
                    figs[reference] = fig
                pairs.append((figs[False], figs.get(True)))
            if args.trials > 1 or args.reference:
                print_summary(name, pairs)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(reports if len(reports) != 1 else reports[0], indent=2) + "\n")
        if home is not None:
            if args.keep_home:
                print(f"home kept: {home}")
            else:
                shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
