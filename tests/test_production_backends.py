"""Real runs of the tiny model on every production adapter at once: the Kafka queue, the Redis
reward cache, the S3 object store and the PostgreSQL state store (tests/servers/), with pods as
local processes and the scheduler as its own process (``services.tooling.chaos.Chaos``).

One run undisturbed, with evidence that each server was used; then two runs under faults, each
counted by the driver as it happened, and the same audit (``services.tooling.run_audit.audit_run``):

- run A: rollout workers SIGKILLed mid-batch, the scheduler killed and restarted, Redis
  unresponsive for ``OUTAGE_S`` (6 s);
- run B: a training job killed after publishing its version, before its commit reached Kafka;
  the broker unresponsive for 6 s; S3 unresponsive for 6 s while a version is published.

A worker is killed at any point of its batch, queueing it included: each GRPO group is one Kafka
record (``contracts.samples.encode_group``), which the broker appends whole or not at all, so no
part of a group is ever left behind.

Levers on the servers (``services.tooling.chaos_plan.Levers``): Redis, moto and the broker are paused by
SIGSTOP/SIGCONT (``paused()``), which looks like a hung or partitioned server: the kernel accepts
connections, nothing answers. Withholding a commit on Kafka needs more than a paused broker: a
request written before the pause sits in the broker's socket buffer and is applied once it runs
again, even if the process that sent it was killed meanwhile (measured: such a commit lands). So
the module's broker is reached only through a ``Link``, a relay that can be cut: while cut
nothing passes, and the bytes of a process that dies meanwhile are lost with it, as when a pod's
machine is lost before its commit left it.

Slow by nature (each pod is a Python process that imports torch): the tiny model, short sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kafka.admin import KafkaAdminClient
from sqlalchemy.engine import make_url

from services.core.config import Settings
from services.domain.names import pod_log_key, policy_prefix, prompts_topic, samples_topic
from services.ports.launcher.launcher import PodPhase
from services.ports.objects.s3_object_store import S3ObjectStore
from services.ports.queue.kafka_queue import KafkaQueue
from services.ports.reward_cache.redis_reward_cache import KEY_PREFIX, RedisRewardCache
from services.ports.state.state_ledger import LedgerEntry
from services.ports.wiring import Backends, open_backends
from services.tooling.chaos import Chaos
from services.tooling.chaos_plan import ChaosPlan, ChaosTally, Levers
from services.tooling.run_audit import Audit, audit_run
from tests.servers.kafka import TEST_SESSION_RANGE, KafkaBroker, tansu_binary
from tests.servers.postgres import PostgresServer
from tests.servers.process import free_port, wait_until_it_answers
from tests.servers.redis import RedisServer
from tests.servers.s3 import S3Bucket
from tests.test_chaos import SPEC as CHAOS_SPEC

pytestmark = pytest.mark.slow

# The embedded chaos run's, one iteration shorter; threshold, as the tests count its pods
# (cost-aware may add a standby between jobs).
SPEC = {**CHAOS_SPEC, "iterations": 3, "cost_policy": "threshold"}
NO_CHAOS = ChaosPlan(worker_kills=0, training_kills=0, scheduler_restarts=0)
OUTAGE_S = 6.0  # longer than the adapters' retries and timeouts (1-3 s), shorter than a run
RUN_TIMEOUT_S = 240.0


# --- a broker behind a link that can be cut --------------------------------------------------
class Link:
    """A TCP relay from a loopback port to ``127.0.0.1:upstream_port``, that can be cut.

    While cut (``with link.cut():``) nothing passes either way: what each side sends waits in the
    relay, and goes on when the link is mended, except what a connection's client sent before it
    closed, which is lost with it (a machine that vanished takes its unsent bytes along). Mending
    waits until the relay has read everything the sockets hold, so a client that died during the
    cut (its FIN already queued) is seen to have closed before anything of it passes. One
    thread, one selector: connections are accepted at any time, cut or not.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._mended: threading.Event | None = None  # set by the relay once a mend asked for is done
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kafka-link", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        self._cut.set()
        try:
            yield
        finally:
            self._mended = mended = threading.Event()
            if not mended.wait(timeout=30):
                self._cut.clear()
                raise RuntimeError("the link's relay did not mend it")

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        peer: dict[socket.socket, socket.socket] = {}
        clients: set[socket.socket] = set()
        held: dict[socket.socket, bytearray] = {}  # read from a socket while cut, for its peer
        out: dict[socket.socket, bytearray] = {}  # to be written to a socket

        def watch(s: socket.socket) -> None:
            sel.modify(s, selectors.EVENT_READ | (selectors.EVENT_WRITE if out[s] else 0))

        def pass_on(s: socket.socket) -> None:
            out[peer[s]] += held[s]
            held[s].clear()
            watch(peer[s])

        def drop(s: socket.socket) -> None:
            """``s`` closed: close its peer too, after what is owed to it unless the link is cut."""
            for end in (s, peer.get(s)):
                if end is None or end not in out:
                    continue
                if end in clients and self._cut.is_set():
                    pass  # what it sent during the cut (held[end]) is lost with it
                elif end is not s and out[end]:
                    with contextlib.suppress(OSError):
                        end.setblocking(True)
                        end.sendall(out[end])
                sel.unregister(end)
                end.close()
                for table in (peer, held, out):
                    table.pop(end, None)
                clients.discard(end)

        while not self._closed.is_set():
            mending = self._mended
            ready = sel.select(timeout=0 if mending else 0.02)
            if mending is not None and not any(events & selectors.EVENT_READ for _, events in ready):
                self._cut.clear()  # everything the sockets held has been read
                self._mended = None
                mending.set()
            for key, events in ready:
                s = key.fileobj
                assert isinstance(s, socket.socket)
                if s is self._listener:
                    client, _ = s.accept()
                    try:
                        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    except OSError:  # the broker is not listening (yet): nor is the link
                        client.close()
                        continue
                    for end, other in ((client, upstream), (upstream, client)):
                        end.setblocking(False)
                        peer[end], held[end], out[end] = other, bytearray(), bytearray()
                        sel.register(end, selectors.EVENT_READ)
                    clients.add(client)
                    continue
                if s not in out:
                    continue  # dropped earlier in this round
                if events & selectors.EVENT_WRITE and out[s]:
                    try:
                        out[s] = out[s][s.send(out[s]) :]
                    except BlockingIOError:
                        pass
                    except OSError:
                        drop(s)
                        continue
                    watch(s)
                if events & selectors.EVENT_READ:
                    try:
                        data = s.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        drop(s)
                        continue
                    held[s] += data  # behind what was held before it, in order
                    if not self._cut.is_set():
                        pass_on(s)
            if not self._cut.is_set():
                for s in [s for s, data in held.items() if data]:
                    pass_on(s)
        for s in list(out):
            s.close()
        self._listener.close()


class BrokerBehindLink(KafkaBroker):
    """A tansu broker (as tests/servers/kafka.py starts one) whose clients all reach it through a
    ``Link``: it advertises the link's address, so ``url`` and every metadata answer name the link."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="spotrl-tansu-link-"))
        self._log = self._dir / "tansu.log"
        broker_port = free_port()
        self.link = Link(broker_port)
        self.port = self.link.port
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    tansu_binary(),
                    "broker",
                    "--listener-url",
                    f"tcp://127.0.0.1:{broker_port}",
                    "--advertised-listener-url",
                    f"tcp://127.0.0.1:{self.port}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.pid = self._proc.pid
        wait_until_it_answers(self._proc, "tansu", self._answers, self._log, timeout_s=20.0)

    def stop(self) -> None:
        super().stop()
        self.link.close()


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerBehindLink]:
    b = BrokerBehindLink()
    yield b
    b.stop()


# --- the run's settings, levers and driver ----------------------------------------------------
@pytest.fixture
def settings(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    broker: BrokerBehindLink,
    redis_url: str,
    s3_bucket: S3Bucket,
    postgres_url: str,
) -> Settings:
    """conftest's settings, on the production adapters (the ``api`` fixture and the pods use them).
    The queue URL carries the test broker's workarounds (tests/servers/kafka.py): Kafka session
    timeouts of 1-2 s, and every record in a batch of its own. The AWS settings are in this
    process's environment (``s3_bucket``), which the scheduler and the pods inherit."""
    (tmp_path / "data").mkdir()
    return Settings(
        home=tmp_path / "home",
        model_cache=tmp_path_factory.getbasetemp() / "models",
        tick_seconds=0.2,
        lease_seconds=2.0,
        session_timeout_s=3.0,
        stop_grace_s=10.0,
        data_dirs=str(tmp_path / "data"),
        queue_url=f"{broker.url}?{TEST_SESSION_RANGE}&batch_size=1",
        reward_cache_url=redis_url,
        objects_url=s3_bucket.url,
        state_url=postgres_url,
    )


@pytest.fixture
def levers(broker: BrokerBehindLink, redis_server: RedisServer, s3_bucket: S3Bucket) -> Levers:
    return Levers(
        withhold_commits=broker.link.cut,
        queue_outage=broker.paused,
        reward_cache_outage=redis_server.paused,
        object_store_outage=s3_bucket.server.paused,
    )


@dataclass(frozen=True)
class Outcome:
    run_id: str
    tally: ChaosTally
    audit: Audit
    ledger: list[LedgerEntry]  # every pod ever started is billed
    decisions: list[str]  # the scheduler's log lines about starting and stopping the run's pods

    @property
    def pods(self) -> Counter[str]:
        """The run's pods by role, each pod counted once however many entries it has."""
        return Counter(role for _, role in {(e.pod, e.role) for e in self.ledger})

    def ledger_lines(self) -> str:
        """The ledger for a failure's reader: who ran when, relative to the first start."""
        t0 = min((e.started_at for e in self.ledger), default=0.0)
        return "\n".join(
            [
                *self.decisions,
                *(
                    f"{e.pod} {e.started_at - t0:.1f}..{'open' if e.ended_at is None else f'{e.ended_at - t0:.1f}'} s"
                    for e in self.ledger
                ),
            ]
        )


async def run_under(
    api: httpx.AsyncClient, settings: Settings, levers: Levers, plan: ChaosPlan, log_dir: Path, **spec_changes: object
) -> Outcome:
    """Submit a run, drive it with ``Chaos`` until it ends, and audit it."""
    response = await api.post("/v1/runs", json={**SPEC, **spec_changes})
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]
    backends = open_backends(settings)
    try:
        assert isinstance(backends.queue, KafkaQueue) and isinstance(backends.objects, S3ObjectStore)
        assert isinstance(backends.rewards, RedisRewardCache) and settings.resolved_state_url().startswith("postgresql")

        def drive() -> tuple[ChaosTally, bool]:
            with Chaos(settings, backends, run_id, plan, log_dir=log_dir, levers=levers) as chaos:
                ended = chaos.wait(timeout_s=RUN_TIMEOUT_S)
            return chaos.tally, ended

        tally, ended = await asyncio.to_thread(drive)
        assert ended, f"the run did not end: {backends.state.get_run(run_id).status}; {tally.line()}\n" + stuck(
            backends, run_id, log_dir
        )
        audit = audit_run(backends, run_id)
        print(tally.line(), *audit.lines(), sep="\n")  # shown with -s, and on failure
        ledger = backends.state.ledger(run_id)
        for pod, text in pod_logs(settings, run_id).items():  # beside the scheduler's, for a failure's reader
            (log_dir / f"{pod}.log").write_text(text)
    finally:
        for pod in backends.launcher.list():  # nothing of ours is left running
            if pod.phase == PodPhase.RUNNING and pod.pid:
                os.kill(pod.pid, signal.SIGKILL)
        backends.close()
    decisions = [
        line
        for path in sorted(log_dir.glob("scheduler-*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if f"run {run_id}: " in line
    ]
    return Outcome(run_id, tally, audit, ledger, decisions)


def stuck(backends: Backends, run_id: str, log_dir: Path, lines: int = 150) -> str:
    """The last lines of the scheduler's and the running pods' logs, stacks included (Chaos.wait)."""
    tails = {
        path.name: "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        for path in sorted(log_dir.glob("scheduler-*.log"))
    }
    for pod in backends.launcher.list(run_id):
        if pod.phase == PodPhase.RUNNING:
            tails[pod.name] = backends.launcher.logs(pod.name, tail=lines)
    return "\n".join(f"--- {name}\n{text}" for name, text in tails.items())


def pod_logs(settings: Settings, run_id: str) -> dict[str, str]:
    """The logs of the run's ended pods, as the scheduler kept them in the object store."""
    objects = S3ObjectStore.from_url(settings.objects_url or "")
    prefix = pod_log_key(run_id, "x").removesuffix("x.log")
    return {
        key.removeprefix(prefix).removesuffix(".log"): objects.get_bytes(key).decode(errors="replace")
        for key in objects.list(prefix)
    }


def assert_guarantees_held(audit: Audit, iterations: int) -> None:
    assert audit.problems == []
    assert audit.status == "SUCCEEDED"
    assert audit.policy_versions == list(range(1, iterations + 1)) and audit.policy_version == iterations
    assert audit.produced == audit.trained + audit.dropped > 0  # audited by id; the totals, for the reader
    assert audit.prompts_committed > 0 and audit.ledger_entries > 0 and audit.open_entries == 0


# --- the tests ----------------------------------------------------------------------------------
async def test_a_run_on_every_production_adapter(
    api: httpx.AsyncClient,
    settings: Settings,
    levers: Levers,
    tmp_path: Path,
    broker: BrokerBehindLink,
    redis_server: RedisServer,
    s3_bucket: S3Bucket,
    postgres: PostgresServer,
) -> None:
    outcome = await run_under(api, settings, levers, NO_CHAOS, tmp_path / "chaos")
    run_id, audit = outcome.run_id, outcome.audit
    assert_guarantees_held(audit, SPEC["iterations"])
    assert outcome.pods == {"rollout": 2, "training": SPEC["iterations"]}, outcome.ledger_lines()
    assert len(outcome.ledger) == sum(outcome.pods.values()), outcome.ledger_lines()  # each pod billed once

    # Each server was used, seen with its own client rather than through the adapters.
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert {prompts_topic(run_id), samples_topic(run_id)} <= set(admin.list_topics())
    finally:
        admin.close()
    queue = KafkaQueue(settings.queue_url or "")
    try:
        groups = sum(queue.end_offsets(samples_topic(run_id)).values())  # a record per group of samples
        assert groups * SPEC["samples_per_prompt"] == audit.produced
    finally:
        queue.close()
    client = redis_server.client()
    try:
        assert client.keys(f"{KEY_PREFIX}*"), "no reward in Redis"
    finally:
        client.close()
    s3 = s3_bucket.server.client()
    latest = f"spotrl/{policy_prefix(run_id, SPEC['iterations'])}"  # s3_bucket.url's prefix, then the key
    assert s3.list_objects_v2(Bucket=s3_bucket.name, Prefix=latest)["KeyCount"] > 0, f"nothing under {latest}"
    assert not (settings.home / "objects").exists(), "objects went to the embedded store"
    with postgres.connect(make_url(settings.resolved_state_url()).database) as conn:
        row = conn.execute("SELECT status, policy_version FROM runs WHERE id = %s", (run_id,)).fetchone()
    assert row == ("SUCCEEDED", SPEC["iterations"])
    # Nor did any process (the pods included) fall back on an embedded store in the home directory.
    assert not [name for name in ("state.db", "queue.db", "reward-cache.db") if (settings.home / name).exists()]


async def test_workers_killed_the_scheduler_restarted_and_redis_unresponsive(
    api: httpx.AsyncClient, settings: Settings, levers: Levers, tmp_path: Path
) -> None:
    plan = ChaosPlan(
        worker_kills=2, training_kills=0, scheduler_restarts=1, reward_cache_outages=1, outage_s=OUTAGE_S, pause_s=2.0
    )
    outcome = await run_under(api, settings, levers, plan, tmp_path / "chaos", iterations=4)
    tally = outcome.tally
    assert_guarantees_held(outcome.audit, 4)
    # Each fault happened, for real.
    assert len(tally.worker_kills) >= 1, tally.line()
    assert tally.scheduler_kills == 1 and tally.scheduler_starts == 2, tally.line()
    (outage,) = tally.of("reward cache")
    assert outage.seconds >= OUTAGE_S, tally.line()
    # No worker was started but in place of a killed one (one killed late needs none), no job retried.
    assert 2 <= outcome.pods["rollout"] <= 2 + len(tally.worker_kills), (outcome.ledger_lines(), tally.line())
    assert outcome.pods["training"] == 4, (outcome.ledger_lines(), tally.line())
    # The workers saw Redis go and carried on without it (the adapter logs it once per outage).
    logs = pod_logs(settings, outcome.run_id)
    assert any("carrying on without the cache" in text for pod, text in logs.items() if "-rollout-" in pod), sorted(
        logs
    )


async def test_a_job_killed_before_its_commit_the_broker_and_s3_unresponsive(
    api: httpx.AsyncClient, settings: Settings, levers: Levers, tmp_path: Path, broker: BrokerBehindLink
) -> None:
    plan = ChaosPlan(
        worker_kills=0,
        training_kills=1,
        scheduler_restarts=0,
        queue_outages=1,
        object_store_outages=1,
        outage_s=OUTAGE_S,
        pause_s=2.0,
    )
    # Sessions that outlast the broker's outage. Two members rejoining the test broker at once can
    # livelock it (measured: each JoinGroup answered at once with the same generation, then its
    # SyncGroup failed by the other's join, for minutes); Kafka's join phase waits for every
    # member instead. Run A has its members rejoin one at a time, after a kill.
    session = 3 * OUTAGE_S / 2
    settings = settings.model_copy(
        update={
            "session_timeout_s": session,
            "queue_url": f"{broker.url}?session_timeout_min_s=1&session_timeout_max_s={session}&batch_size=1",
        }
    )
    outcome = await run_under(api, settings, levers, plan, tmp_path / "chaos", iterations=3)
    tally = outcome.tally
    assert_guarantees_held(outcome.audit, 3)
    # Each fault happened, for real. A training kill counts only if the job's commit is still
    # missing once the link is mended (Chaos._kill_between_publish_and_commit). Whether the job
    # had sent its commit into the cut link (lost with it) or was still waiting inside the Kafka
    # client for an earlier request the cut held (a fetch, a heartbeat) is timing: one CI run saw
    # nothing of it lost, with the kill counted and every guarantee held.
    assert len(tally.training_kills) == 1, tally.line()
    (queue_outage,) = tally.of("queue")
    (objects_outage,) = tally.of("object store")
    assert queue_outage.seconds >= OUTAGE_S and objects_outage.seconds >= OUTAGE_S, tally.line()
    assert objects_outage.iteration is not None and objects_outage.iteration not in tally.training_kills
    # No worker fell over and no job had to be retried through the outages: one pod each.
    assert outcome.pods == {"rollout": 2, "training": 3}, (outcome.ledger_lines(), tally.line())
