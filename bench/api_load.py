"""Load on the REST API: `spotrl serve` under concurrent clients (a benchmark, not a test).

    .venv/bin/python bench/api_load.py [--scenario idle|no-scheduler|one-run|all]
        [--clients 50] [--seconds 60] [--runs 100] [--history 5] [--writes 0.05]
        [--mix get=0.5,cost=0.3,list=0.2] [--rate R] [--client raw|httpx] [--procs 1]
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

It prints requests/s, p50/p90/p99 latency of reads and of writes (and of each operation),
errors (transport errors and any non-2xx but a 409 on cancel), and the CPU seconds over the
measured window of the server (/proc/<pid>/stat, all its threads, not the pods), of the load
generator (getrusage of each of its processes) and of everything else on the machine
(/proc/stat less those two: pods, or other people's work on a shared machine, which it warns
about). The default client is a minimal keep-alive HTTP/1.1 client over asyncio streams: on 2
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
    def start(cls, home: Path, *, scheduler: bool, env: dict[str, str]) -> Server:
        """`spotrl serve` of the ``ROOT`` checkout (``python -m services.cli.main``, which is what the
        ``spotrl`` script runs; ROOT on PYTHONPATH, so the pods it launches run ROOT's code too)."""
        port = free_port()
        log_path = home / f"server-{port}.log"
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
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(
                    f"spotrl serve exited with {proc.returncode}; see {log_path}:\n{log_path.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{server.url}/healthz", timeout=1, trust_env=False).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        server.stop()
        raise SystemExit(f"spotrl serve did not answer /healthz within 60 s; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn shuts down cleanly; the scheduler releases its lease
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
    from services.ports.state.state_schema import IterationRow
    from services.ports.state.state_store import StateStore

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
                pod = f"{run_id}-train-{i}"
                state.open_ledger(
                    run_id=run_id,
                    role="training",
                    pod=pod,
                    instance_type="p4d.24xlarge",
                    capacity_type="on-demand",
                    price_per_hour=21.96,
                    price_source="api_load (seeded)",
                    started_at=t + 30.0,
                )
                state.close_ledger(pod, ended_at=t + 40.0)
                state.record_iteration(
                    IterationRow(
                        run_id=run_id,
                        iteration=i,
                        policy_version=i,
                        mean_reward=rng.random(),
                        kl=rng.random() / 10,
                        loss=rng.random(),
                        seconds=10.0,
                        samples_trained=8,
                        samples_dropped=0,
                        metrics={k: rng.random() for k in METRIC_KEYS},
                        ended_at=t + 40.0,
                    )
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


# --- the load -------------------------------------------------------------------------------
@dataclass
class Load:
    """What one load process is to do; picklable for --procs."""

    url: str
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
    http = CLIENTS[load.client](load.url, load.clients, headers(load.token), 30.0)
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
    if cpu["other"] is not None and cpu["other"] > 0.1 * span and fig["scenario"] != "one-run":
        print(
            f"  warning: other processes took {cpu['other']:.1f} CPU seconds during the window (pods, or someone else's work "
            "on this machine): the server had less than the machine"
        )
    print(
        f"  list ?limit={LIST_LIMIT} honoured: {fig['list_limit_honoured']}; runs in the store at the end: {fig['runs_at_end']}; "
        f"written runs that got pods: {fig['written_runs_with_pods']}"
    )


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
    name: str, args: argparse.Namespace, home: Path | None, run_ids: list[str], server_env: dict[str, str]
) -> dict:
    scheduler, active, description = SCENARIOS[name]
    server = None
    active_id = None
    if args.url:
        url = args.url
        pid = args.server_pid
    else:
        assert home is not None
        server = Server.start(home, scheduler=scheduler, env=server_env)
        url, pid = server.url, server.proc.pid
    profiler = None
    try:
        if active:
            print(f"[{name}] starting the active run, waiting for its first iteration ...", flush=True)
            active_id = start_active_run(url, args.token, args.active_timeout)
        targets = run_ids + ([active_id] if active_id else [])
        honoured, _ = probe(url, args.token, targets)
        print(f"[{name}] {args.clients} clients, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s ...", flush=True)
        start_at = time.time() + 1.0 + args.warmup
        per_proc_clients = [args.clients // args.procs + (i < args.clients % args.procs) for i in range(args.procs)]
        loads = [
            Load(
                url=url,
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
            return (proc_cpu_seconds(pid) if pid else None), machine_busy_seconds()

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
        _, runs_at_end = probe(url, args.token, targets)
        if home is not None:  # the list may be paginated: count in the store itself
            runs_at_end = count_in_store(home, "SELECT count(*) FROM runs") or runs_at_end
        fig.update(
            scenario=name,
            description=description + (f" ({active_id})" if active_id else ""),
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
        if server is not None:
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
    parser.add_argument("--json", default=None, metavar="OUT", help="Write the figures of every scenario to OUT.")
    parser.add_argument("--keep-home", action="store_true", help="Keep the temporary --home (server logs, state.db).")
    args = parser.parse_args()
    if args.url and args.scenario == "all":
        parser.error("--url loads one running server: give the --scenario it is in")

    global ROOT
    if args.root:
        ROOT = Path(args.root).resolve()
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
            fig = run_scenario(name, args, home, run_ids, server_env)
            print_report(fig)
            reports.append(fig)
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
