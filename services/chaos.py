"""Chaos on one machine: kill what a real run depends on while it runs, then audit the run.

``Chaos`` runs the scheduler as its own process (``spotrl scheduler``) beside a run on the
embedded backends and, from a thread, disrupts it for real:

- SIGKILLs rollout workers mid-run (their uncommitted prompts go to other workers);
- SIGKILLs a training job after it published its policy version and wrote its result, before it
  committed its samples: the window the delivery rules are about. It is microseconds wide, so
  the monkey widens it without touching the job: once the job starts publishing (its policy
  directory appears in the object store) the monkey takes the embedded queue's write lock, as a
  slow broker would; the job writes its result, then blocks in its commit, and is killed there.
  The lock is released once the job is dead, and the kill counts only if its commit is indeed
  missing then (the job's own code path, unmodified, in its own process);
- SIGKILLs the scheduler, or stops it with SIGTERM (which releases its lease), and starts a new
  one each time: the new one resumes from the state store and the launcher's pods.

``audit_run`` then checks the promises of README "Guarantees" on what the stores hold: no prompt
lost, no sample trained twice, every sample trained or counted dropped (and the run's counters
saying so), policy versions increasing, every ledger entry closed, no pod left, the run ended.
``spotrl demo --chaos`` and tests/test_chaos.py both use these two.

Control plane only (no torch): it reads the stores and signals processes by pid, so it needs the
embedded backends on this machine.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from contracts.job_result import JobResult
from contracts.messages import PromptMessage
from contracts.samples import Sample, decode_sample
from contracts.status import RunStatus
from services.backends.launcher import LocalLauncher, PodPhase, PodStatus
from services.backends.queue import Queue, Record
from services.backends.sqlite_queue import SqliteQueue
from services.config import Settings
from services.names import (
    ROLLOUT_GROUP,
    TRAINER_GROUP,
    leftover_key,
    policy_prefix,
    prompts_topic,
    result_key,
    samples_topic,
)
from services.scheduler.lease import SCHEDULER_LEASE
from services.wiring import Backends

log = logging.getLogger(__name__)

# How often the monkey looks at the run's pods and progress.
_LOOK_S = 0.05
# How often it looks for a training job publishing: the window from a job's first policy file to
# its commit is a few tens of milliseconds on the tiny model.
_WATCH_S = 0.002
# Longest the monkey holds the queue's write lock waiting for a publishing job's result; writers
# wait up to the SQLite busy timeout (30 s), so this stays well below it.
_LOCK_HOLD_MAX_S = 15.0


# --- the audit ------------------------------------------------------------------------
@dataclass
class Audit:
    """What the stores say about one run, and every broken promise found (``problems``)."""

    run_id: str
    status: str
    produced: int  # samples queued, by the queue
    trained: int  # samples in the stored results' trained ids
    dropped: int  # samples in the results' dropped ids and the run's leftovers
    dropped_by_reason: dict[str, int]  # duplicate, stale, uneven, run_ended
    counted: dict[str, int]  # the run's own counters: produced, trained, dropped
    policy_versions: list[int]  # of the recorded iterations, in order
    policy_version: int  # the run's
    prompts_published: int
    prompts_committed: int
    ledger_entries: int
    open_entries: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        c = self.counted
        return [
            f"run {self.run_id} {self.status}; policy v{self.policy_version}, iterations' versions {self.policy_versions}",
            f"samples: produced {self.produced}, trained {self.trained}, dropped {self.dropped} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.dropped_by_reason.items())) or 'none'}; "
            f"the run counts {c['produced']} / {c['trained']} / {c['dropped']})",
            f"prompts: published {self.prompts_published}, committed by workers {self.prompts_committed}",
            f"ledger: {self.ledger_entries} entries, {self.open_entries} open",
        ] + [f"PROBLEM: {p}" for p in self.problems]


def _read_all(queue: Queue, topic: str) -> list[Record]:
    """Every record of ``topic``, read by a consumer group of its own (from the start)."""
    want = sum(queue.end_offsets(topic).values())
    consumer = queue.consumer(topic, f"audit-{uuid.uuid4().hex[:8]}", member_id="audit")
    records: list[Record] = []
    try:
        while len(records) < want:
            batch = consumer.poll(1000, timeout_s=1.0)
            if not batch:
                break
            records += batch
    finally:
        consumer.close()
    return records


def _committed_prefix(records: list[Record], committed: dict[int, int]) -> list[Record]:
    return [r for r in records if r.offset < committed.get(r.partition, 0)]


def audit_run(backends: Backends, run_id: str) -> Audit:
    """Check an ended run against the guarantees, from the queue, the object store, the state
    store and the launcher (module docstring). Problems are collected, not raised."""
    run = backends.state.get_run(run_id)
    problems: list[str] = []
    started = run.started_at is not None

    samples: list[Sample] = [decode_sample(r.value) for r in _read_all(backends.queue, samples_topic(run_id))] if started else []
    produced = [s.sample_id for s in samples]

    # Trained and dropped, from what each recorded iteration's job wrote.
    iterations = backends.state.iterations(run_id)
    trained: list[str] = []
    dropped: list[str] = []
    reasons: Counter[str] = Counter()
    for it in iterations:
        result = JobResult.from_json(backends.objects.get_bytes(result_key(run_id, it.iteration)))
        trained += result.trained_ids
        for reason, ids in result.dropped.model_dump().items():
            dropped += ids
            reasons[reason] += len(ids)
        if result.policy_version != it.iteration or it.policy_version != it.iteration:
            problems.append(f"iteration {it.iteration} published v{result.policy_version}, recorded v{it.policy_version}")
        if (len(result.trained_ids), result.dropped.count()) != (it.samples_trained, it.samples_dropped):
            problems.append(f"iteration {it.iteration}: recorded counts differ from its result")
    # The chunks under runs/<run>/leftover/ (services.scheduler.loop), or one leftover.json of older runs.
    for key in backends.objects.list(leftover_key(run_id).removesuffix(".json")):
        if key.endswith(".json"):
            ids = _json_ids(backends.objects.get_bytes(key))
            dropped += ids
            reasons["run_ended"] += len(ids)

    # Every published result is a recorded iteration (a job killed after publishing included).
    recorded = {it.iteration for it in iterations}
    for key in backends.objects.list(f"runs/{run_id}/trainer/"):
        if (m := re.search(r"/v(\d+)/result\.json$", key)) and int(m.group(1)) not in recorded:
            problems.append(f"v{m.group(1)} was published (its result is stored) but is not a recorded iteration")

    if len(trained) != len(set(trained)):
        twice = [i for i, k in Counter(trained).items() if k > 1]
        problems.append(f"{len(twice)} samples trained more than once, e.g. {twice[:3]}")
    accounted, queued = Counter(trained + dropped), Counter(produced)
    if accounted != queued:
        missing = list((queued - accounted).elements())
        extra = list((accounted - queued).elements())
        problems.append(
            f"samples neither trained nor dropped: {len(missing)} {missing[:3]}; trained or dropped more often than "
            f"queued (or never queued): {len(extra)} {extra[:3]}"
        )
    counted = {"produced": run.samples_produced, "trained": run.samples_trained, "dropped": run.samples_dropped}
    if counted != {"produced": len(produced), "trained": len(trained), "dropped": len(dropped)}:
        problems.append(f"the run counts {counted}, the stores hold produced {len(produced)}, trained {len(trained)}, "
                        f"dropped {len(dropped)}")
    if run.samples_produced != run.samples_trained + run.samples_dropped:
        problems.append(f"produced {run.samples_produced} != trained {run.samples_trained} + dropped {run.samples_dropped}")

    # Policy versions: one per iteration, increasing; the run's is the last; workers never go back.
    versions = [it.policy_version for it in iterations]
    if versions != list(range(1, len(versions) + 1)):
        problems.append(f"the iterations' policy versions are {versions}, not 1..{len(versions)}")
    if run.policy_version != (versions[-1] if versions else 0):
        problems.append(f"the run reports policy v{run.policy_version}, its last iteration published v{versions[-1] if versions else 0}")
    if versions and not backends.objects.list(policy_prefix(run_id, versions[-1])):
        problems.append(f"policy v{versions[-1]} is not in the object store")
    by_worker: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_worker[s.worker_id].append(s)
    for worker, theirs in by_worker.items():
        seen = [s.policy_version for s in sorted(theirs, key=lambda s: s.created_at)]
        if seen != sorted(seen):
            problems.append(f"worker {worker} generated with policy versions going back: {seen}")

    # No prompt lost: each prompt a worker committed became a whole group of samples.
    prompts_committed = 0
    if started:
        topic = prompts_topic(run_id)
        prompt_records = _read_all(backends.queue, topic)
        done = _committed_prefix(prompt_records, backends.queue.committed(topic, ROLLOUT_GROUP))
        prompts_committed = len(done)
        if len(prompt_records) < run.prompts_published:
            problems.append(f"{run.prompts_published} prompts published, {len(prompt_records)} in the queue")
        groups: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            groups[s.group_id].append(s)
        n = int(run.spec.get("samples_per_prompt", 4))
        generated = Counter(g[0].prompt_id for g in groups.values() if len(g) == n)
        if broken := [gid for gid, g in groups.items() if len(g) != n]:
            problems.append(f"{len(broken)} groups of samples are not whole ({n} samples each), e.g. {broken[:3]}")
        wanted = Counter(PromptMessage.decode(r.value).prompt_id for r in done)
        if short := {p: (k, generated[p]) for p, k in wanted.items() if generated[p] < k}:
            problems.append(f"prompts committed without their samples (prompt: committed, generated): {short}")

    # The ledger: every entry closed, no pod billed twice over the same seconds; no pod left.
    ledger = backends.state.ledger(run_id)
    open_entries = [e.pod for e in ledger if e.ended_at is None]
    if open_entries:
        problems.append(f"ledger entries still open: {open_entries}")
    by_pod: dict[str, list[Any]] = defaultdict(list)
    for e in ledger:
        by_pod[e.pod].append(e)
    for pod, entries in by_pod.items():
        entries.sort(key=lambda e: e.started_at)
        for a, b in zip(entries, entries[1:]):
            if a.ended_at is None or b.started_at < a.ended_at:
                problems.append(f"pod {pod} is billed twice from {b.started_at:.3f}")
    if left := [p.name for p in backends.launcher.list(run_id)]:
        problems.append(f"pods left: {left}")
    if not RunStatus(run.status).is_terminal():
        problems.append(f"the run has not ended: {run.status}")

    return Audit(
        run_id=run_id, status=run.status, produced=len(produced), trained=len(trained), dropped=len(dropped),
        dropped_by_reason=dict(reasons),
        counted=counted, policy_versions=versions, policy_version=run.policy_version,
        prompts_published=run.prompts_published, prompts_committed=prompts_committed,
        ledger_entries=len(ledger), open_entries=len(open_entries), problems=problems,
    )


def _json_ids(data: bytes) -> list[str]:
    return list(json.loads(data)["run_ended"])


# --- the monkey -----------------------------------------------------------------------
@dataclass(frozen=True)
class ChaosPlan:
    """How much to break. Disruptions of workers and the scheduler take turns, ``pause_s`` apart
    at least; a training job is killed whenever one is caught publishing, up to ``training_kills``."""

    worker_kills: int = 3
    training_kills: int = 1
    scheduler_restarts: int = 2  # alternately after a SIGKILL and after a SIGTERM
    pause_s: float = 5.0
    seed: int = 0


@dataclass
class ChaosTally:
    """What the monkey did."""

    worker_kills: list[str] = field(default_factory=list)  # pods SIGKILLed
    training_kills: list[int] = field(default_factory=list)  # iterations killed after publishing, before committing
    training_missed: int = 0  # jobs caught publishing that committed before the kill (nothing to count)
    scheduler_kills: int = 0  # SIGKILLs
    scheduler_stops: int = 0  # SIGTERMs (a clean stop, the lease released)
    scheduler_starts: int = 0

    def line(self) -> str:
        return (
            f"chaos: {len(self.worker_kills)} rollout workers SIGKILLed; training jobs SIGKILLed between publish and "
            f"commit: iterations {self.training_kills or 'none'} ({self.training_missed} missed); scheduler "
            f"SIGKILLed {self.scheduler_kills}x, SIGTERMed {self.scheduler_stops}x, started {self.scheduler_starts}x"
        )


class Chaos:
    """The scheduler as a child process, and two threads breaking things while ``run_id`` runs:
    one kills workers and the scheduler by turns, one watches for training jobs publishing.

    ``with Chaos(settings, backends, run_id, plan, log_dir) as chaos:`` starts them; leaving the
    block stops the monkey, then the scheduler (SIGTERM). ``chaos.tally`` says what was done.
    The monkey stops by itself once the run has ended; the scheduler's logs go to ``log_dir``.
    """

    def __init__(self, settings: Settings, backends: Backends, run_id: str, plan: ChaosPlan, log_dir: Path) -> None:
        if not isinstance(backends.queue, SqliteQueue) or not isinstance(backends.launcher, LocalLauncher):
            raise ValueError("chaos needs the embedded queue (it holds its file's write lock) and local pods (it "
                             "signals their processes): leave SPOTRL_QUEUE_URL unset")
        self._queue_file = settings.home.resolve() / "queue.db"  # where services.wiring.open_queue keeps it
        self.settings = settings
        self.b = backends
        self.run_id = run_id
        self.plan = plan
        self.log_dir = log_dir
        self.tally = ChaosTally()
        self._rng = random.Random(plan.seed)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._guarded, args=(self._disrupt_workers_and_scheduler,), name="chaos", daemon=True),
            threading.Thread(target=self._guarded, args=(self._catch_publishing_jobs,), name="chaos-jobs", daemon=True),
        ]
        self._scheduler: subprocess.Popen[bytes] | None = None
        self._scheduler_log: IO[bytes] | None = None
        self._error: BaseException | None = None
        self._caught: set[int] = set()  # iterations whose job was caught publishing

    def __enter__(self) -> Chaos:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_scheduler()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=_LOCK_HOLD_MAX_S + 60)
        self._end_scheduler(signal.SIGTERM, count=False)
        if self._scheduler_log is not None:
            self._scheduler_log.close()
        if self._error is not None and exc[0] is None:
            raise RuntimeError("the chaos monkey failed") from self._error

    def wait(self, timeout_s: float) -> bool:
        """Wait until the run ends (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if RunStatus(self.b.state.get_run(self.run_id).status).is_terminal():
                return True
            if self._error is not None:
                raise RuntimeError("the chaos monkey failed") from self._error
            time.sleep(0.2)
        return False

    # --- the scheduler process -----------------------------------------------------------
    def _start_scheduler(self) -> None:
        env = {
            **os.environ,
            **self.settings.pod_env(),
            "SPOTRL_TICK_SECONDS": str(self.settings.tick_seconds),
            "SPOTRL_LEASE_SECONDS": str(self.settings.lease_seconds),
        }
        self.tally.scheduler_starts += 1
        if self._scheduler_log is not None:
            self._scheduler_log.close()
        self._scheduler_log = (self.log_dir / f"scheduler-{self.tally.scheduler_starts}.log").open("wb")
        self._scheduler = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "scheduler"], env=env, stdout=self._scheduler_log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def _end_scheduler(self, signum: signal.Signals, *, count: bool = True) -> None:
        proc = self._scheduler
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signum)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if count:
            if signum == signal.SIGKILL:
                self.tally.scheduler_kills += 1
            else:
                self.tally.scheduler_stops += 1

    def _scheduler_leads(self) -> bool:
        holder = self.b.state.lease_holder(SCHEDULER_LEASE)  # "host:pid:nonce"
        return self._scheduler is not None and holder is not None and holder.split(":")[1] == str(self._scheduler.pid)

    # --- the monkey ---------------------------------------------------------------------
    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # reported by wait() and on leaving the block
            log.exception("the chaos monkey failed")
            self._error = e

    def _run_goes_on(self) -> bool:
        """Until the run ends (or the monkey is stopped); False also while it has not started."""
        run = self.b.state.get_run(self.run_id)
        if RunStatus(run.status).is_terminal():
            self._stop.set()
        return run.started_at is not None and not self._stop.is_set()

    def _disrupt_workers_and_scheduler(self) -> None:
        """Take turns, ``pause_s`` apart: SIGKILL a rollout worker; end the scheduler and start another."""
        plan = self.plan
        turns = ["worker", "scheduler"]
        last = time.monotonic()
        produced_at_last_kill = 0
        while not self._stop.is_set():
            if not self._run_goes_on():
                self._stop.wait(_LOOK_S)
                continue
            pods = self.b.launcher.list(self.run_id)
            produced = sum(self.b.queue.end_offsets(samples_topic(self.run_id)).values())
            if time.monotonic() - last >= plan.pause_s:
                turn = turns[0]
                if turn == "worker" and len(self.tally.worker_kills) < plan.worker_kills:
                    workers = [p for p in _running(pods, "rollout") if p.pid]
                    # Only while samples flow since the last kill, so the run gets somewhere between kills.
                    if workers and produced > produced_at_last_kill:
                        victim = self._rng.choice(workers)
                        _kill(victim.pid, signal.SIGKILL)
                        self.tally.worker_kills.append(victim.name)
                        log.info("chaos: SIGKILLed rollout worker %s", victim.name)
                        produced_at_last_kill, last = produced, time.monotonic()
                        turns.reverse()
                elif turn == "scheduler" and self.tally.scheduler_kills + self.tally.scheduler_stops < plan.scheduler_restarts:
                    if self._scheduler_leads():  # it has got somewhere: it leads
                        signum = signal.SIGKILL if self.tally.scheduler_kills <= self.tally.scheduler_stops else signal.SIGTERM
                        self._end_scheduler(signum)
                        log.info("chaos: scheduler ended by %s; starting a new one", signum.name)
                        self._start_scheduler()
                        last = time.monotonic()
                        turns.reverse()
                else:
                    turns.reverse()
            self._stop.wait(_LOOK_S)

    def _catch_publishing_jobs(self) -> None:
        """Kill up to ``training_kills`` training jobs between publishing and committing."""
        job: PodStatus | None = None
        listed_at = 0.0
        while not self._stop.is_set() and len(self.tally.training_kills) < self.plan.training_kills:
            if time.monotonic() - listed_at > 10 * _LOOK_S:  # the pods now and then, the object store often
                listed_at = time.monotonic()
                job = next(iter(_running(self.b.launcher.list(self.run_id), "training")), None) if self._run_goes_on() else None
            if job is not None:
                self._kill_between_publish_and_commit(job)
            self._stop.wait(_WATCH_S)

    def _kill_between_publish_and_commit(self, job: PodStatus) -> None:
        """If ``job`` has begun publishing its policy version: hold the queue's write lock so that
        its commit cannot happen, wait for its result, SIGKILL it, release (module docstring)."""
        iteration = int(job.labels["iteration"])
        if iteration in self._caught or job.pid is None or not self.b.objects.list(policy_prefix(self.run_id, iteration)):
            return
        self._caught.add(iteration)
        key = result_key(self.run_id, iteration)
        with _queue_write_lock(self._queue_file):
            # From here until the block ends nobody commits: the job blocks in its commit.
            deadline = time.monotonic() + _LOCK_HOLD_MAX_S
            while not self.b.objects.exists(key):
                if time.monotonic() > deadline or _ended(self.b, job.name):
                    return  # it failed, or did not finish publishing in time: nothing to count
                time.sleep(0.002)
            _kill(job.pid, signal.SIGKILL)
            _wait_ended(self.b, job.name)
            # WAL: reads go on under the write lock. Committed already: it did so before the lock was ours.
            committed = self.b.queue.committed(samples_topic(self.run_id), TRAINER_GROUP)
            result = JobResult.from_json(self.b.objects.get_bytes(key))
            if any(committed.get(p, 0) < o for p, o in result.offsets.items()):
                self.tally.training_kills.append(iteration)
                log.info("chaos: SIGKILLed training job %d after it published v%d, before its commit", iteration, iteration)
            else:
                self.tally.training_missed += 1


def _running(pods: list[PodStatus], role: str) -> list[PodStatus]:
    return [p for p in pods if p.role == role and p.phase == PodPhase.RUNNING]


def _kill(pid: int, signum: signal.Signals) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it ended meanwhile
        pass


def _ended(backends: Backends, pod: str) -> bool:
    return all(p.phase != PodPhase.RUNNING for p in backends.launcher.list() if p.name == pod)


def _wait_ended(backends: Backends, pod: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _ended(backends, pod) and time.monotonic() < deadline:
        time.sleep(0.01)


@contextmanager
def _queue_write_lock(path: Path) -> Iterator[None]:
    """The embedded queue's SQLite write lock, held for the block: to writers, a slow broker."""
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()
