"""Chaos on one machine: kill what a real run depends on while it runs, then audit the run.

``Chaos`` runs the scheduler as its own process (``spotrl scheduler``) beside a run whose pods
are local processes and, from two threads, disrupts it for real:

- SIGKILLs rollout workers mid-run (their uncommitted prompts go to other workers);
- SIGKILLs a training job after it published its policy version and wrote its result, before it
  committed its samples: the window the delivery rules are about. It is microseconds wide, so
  the monkey widens it without touching the job: once the job starts publishing (its policy
  directory appears in the object store) the monkey withholds the queue's commits
  (``Levers.withhold_commits``: the embedded queue's write lock, as a slow broker would hold
  writes; on Kafka, a partition between the pods and the brokers); the job writes its result,
  then blocks in its commit, and is killed there. The commits flow again once the job is dead,
  and the kill counts only if its commit is indeed missing then (the job's own code path,
  unmodified, in its own process);
- preempts training jobs on spot capacity as their update begins (their checkpoint's batch is
  stored), as a provider reclaims a node: by turns with its notice (SIGTERM, then SIGKILL if the
  job is still there after ``notice_s``), when the job checkpoints and exits ``EXIT_PREEMPTED``,
  and without (SIGKILL); the local launcher reports either as preempted, and the next job of the
  iteration resumes from the checkpoint;
- SIGKILLs the scheduler, or stops it with SIGTERM (which releases its lease), and starts a new
  one each time: the new one resumes from the state store and the launcher's pods;
- where the backends are real servers the monkey can stop (``Levers``): makes the queue's
  brokers or the reward cache unresponsive for ``outage_s``, by turns with the above (the reward
  cache longer if need be, until a worker's lookups have failed on it), and the object store
  while a training job publishes its policy version (instead of killing that job).

``services.tooling.run_audit.audit_run`` then checks the run against README "Guarantees";
``spotrl demo --chaos`` and tests/test_chaos.py both use the two.

Control plane only (no torch): it reads the stores and signals processes by pid, so its pods are
local processes; on the embedded backends it needs nothing else (``embedded_levers``), on
production adapters the caller hands it the levers of their servers (tests/test_production_backends.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO

from contracts.job_result import JobResult
from contracts.status import RunStatus
from services.control.scheduler.lease import SCHEDULER_LEASE
from services.core.config import Settings
from services.domain.names import (
    TRAINER_GROUP,
    policy_prefix,
    result_key,
    samples_topic,
    update_checkpoint_prefix,
)
from services.ports.launcher.launcher import PodPhase, PodStatus
from services.ports.launcher.local_launcher import LocalLauncher
from services.ports.queue.sqlite_queue import SqliteQueue
from services.ports.wiring import Backends
from services.tooling.chaos_plan import ChaosPlan, ChaosTally, Levers, Outage, embedded_levers

log = logging.getLogger(__name__)

# How often the monkey looks at the run's pods and progress.
_LOOK_S = 0.05
# How often it looks for a training job publishing: the window from a job's first policy file to
# its commit is a few tens of milliseconds on the tiny model.
_WATCH_S = 0.002
# Longest the monkey withholds commits waiting for a publishing job's result; writers to the
# embedded queue wait up to the SQLite busy timeout (30 s), so this stays well below it.
_LOCK_HOLD_MAX_S = 15.0
# How long the monkey lets a job that wrote its result go on before killing it: long enough to be
# inside its commit, which follows at once and cannot complete while commits are withheld.
_INTO_COMMIT_S = 0.5
# Longest the monkey waits for a job that published through an object store outage to write its result.
_RESULT_WAIT_S = 120.0
# Longest a reward cache outage goes on past ``outage_s`` for a worker to meet it: the worker caught
# computing may have been loading its model, and the others waiting for a new policy.
_MEET_MAX_S = 60.0


class Chaos:
    """The scheduler as a child process, and two threads breaking things while ``run_id`` runs:
    one kills workers and the scheduler and stops servers by turns, one watches for training jobs
    publishing (to kill them before their commit, or to stop the object store under them).

    ``with Chaos(settings, backends, run_id, plan, log_dir) as chaos:`` starts them; leaving the
    block stops the monkey, then the scheduler (SIGTERM). ``chaos.tally`` says what was done.
    The monkey stops by itself once the run has ended; the scheduler's logs go to ``log_dir``.
    ``levers``: how to make the backends fail (``Levers``); by default the embedded ones.
    """

    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        run_id: str,
        plan: ChaosPlan,
        log_dir: Path,
        levers: Levers | None = None,
    ) -> None:
        if not isinstance(backends.launcher, LocalLauncher):
            raise ValueError("chaos needs local pods (it signals their processes)")
        if levers is None:
            if not isinstance(backends.queue, SqliteQueue):
                raise ValueError(
                    "on a queue other than the embedded one, chaos needs the levers of its servers "
                    "(Chaos(..., levers=Levers(...))); or leave SPOTRL_QUEUE_URL unset"
                )
            levers = embedded_levers(settings)
        wanted = {
            "queue_outage": plan.queue_outages,
            "reward_cache_outage": plan.reward_cache_outages,
            "object_store_outage": plan.object_store_outages,
        }
        if missing := [name for name, count in wanted.items() if count and getattr(levers, name) is None]:
            raise ValueError(f"the plan asks for outages the levers cannot make: {', '.join(missing)}")
        self.levers = levers
        self.settings = settings
        self.b = backends
        self.run_id = run_id
        self.plan = plan
        self.log_dir = log_dir
        self.tally = ChaosTally()
        self._rng = random.Random(plan.seed)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._guarded, args=(self._disrupt_workers_and_scheduler,), name="chaos", daemon=True
            ),
            threading.Thread(target=self._guarded, args=(self._catch_publishing_jobs,), name="chaos-jobs", daemon=True),
        ]
        self._scheduler: subprocess.Popen[bytes] | None = None
        self._scheduler_log: IO[bytes] | None = None
        self._error: BaseException | None = None
        self._caught: set[int] = set()  # iterations whose job was caught publishing
        self._preempted: set[int] = set()  # iterations whose job was preempted mid-update

    def __enter__(self) -> Chaos:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_scheduler()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=_LOCK_HOLD_MAX_S + self.plan.outage_s + 60)
        self._end_scheduler(signal.SIGTERM, count=False)
        if self._scheduler_log is not None:
            self._scheduler_log.close()
        if self._error is not None and exc[0] is None:
            raise RuntimeError("the chaos monkey failed") from self._error

    def wait(self, timeout_s: float) -> bool:
        """Wait until the run ends (True) or ``timeout_s`` passes (False). On a timeout the
        scheduler and the run's pods print their threads' stacks to their logs (SIGUSR1), so
        the reader of a run that never ended sees where each process was."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if RunStatus(self.b.state.get_run(self.run_id).status).is_terminal():
                return True
            if self._error is not None:
                raise RuntimeError("the chaos monkey failed") from self._error
            time.sleep(0.2)
        pids = [p.pid for p in self.b.launcher.list(self.run_id) if p.phase == PodPhase.RUNNING and p.pid]
        if self._scheduler is not None and self._scheduler.poll() is None:
            pids.append(self._scheduler.pid)
        for pid in pids:
            _kill(pid, signal.SIGUSR1)
        time.sleep(1.0)  # for them to write
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
            [sys.executable, "-m", "services.cli.main", "scheduler"],
            env=env,
            stdout=self._scheduler_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
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
        """Take turns, ``pause_s`` apart: SIGKILL a rollout worker; end the scheduler and start
        another; make the reward cache unresponsive; make the queue unresponsive. A turn with
        nothing left to do passes at once; one whose moment has not come waits for it: workers
        and servers are disrupted while samples flow (some queued since the last disruption, so
        that the run gets somewhere in between), servers when a worker is computing its batch (so
        that it meets the outage), the scheduler once it leads."""
        plan, tally = self.plan, self.tally
        turns = ["worker", "scheduler", "reward cache", "queue"]
        last = time.monotonic()
        produced_at_last = 0
        while not self._stop.is_set():
            if not self._run_goes_on():
                self._stop.wait(_LOOK_S)
                continue
            pods = self.b.launcher.list(self.run_id)
            produced = self._produced()
            workers = [p for p in _running(pods, "rollout") if p.pid]
            flowing = bool(workers) and produced > produced_at_last
            if time.monotonic() - last >= plan.pause_s:
                turn, done = turns[0], False
                if turn == "worker" and len(tally.worker_kills) < plan.worker_kills:
                    # At any point of its batch: computing it, or queueing its groups (each a record).
                    ready = workers if flowing else []
                    if ready:
                        victim = self._rng.choice(ready)
                        _kill(victim.pid, signal.SIGKILL)
                        tally.worker_kills.append(victim.name)
                        log.info("chaos: SIGKILLed rollout worker %s", victim.name)
                        done = True
                elif turn == "scheduler" and tally.scheduler_kills + tally.scheduler_stops < plan.scheduler_restarts:
                    if done := self._scheduler_leads():  # it has got somewhere: it leads
                        signum = signal.SIGKILL if tally.scheduler_kills <= tally.scheduler_stops else signal.SIGTERM
                        self._end_scheduler(signum)
                        log.info("chaos: scheduler ended by %s; starting a new one", signum.name)
                        self._start_scheduler()
                elif turn == "reward cache" and len(tally.of(turn)) < plan.reward_cache_outages:
                    # While a worker computes its batch: it looks the batch's rewards up next.
                    if done := flowing and any(_computing(w.pid) for w in workers if w.pid):
                        assert self.levers.reward_cache_outage is not None  # checked in __init__
                        met = self._reward_cache_errors_grew()
                        self._outage(turn, self.levers.reward_cache_outage, produced, met=met)
                elif turn == "queue" and len(tally.of(turn)) < plan.queue_outages:
                    # While a worker computes its batch: it queues its samples and commits its prompts next.
                    if done := flowing and any(_computing(w.pid) for w in workers if w.pid):
                        assert self.levers.queue_outage is not None
                        self._outage(turn, self.levers.queue_outage, produced)
                else:
                    turns.append(turns.pop(0))  # nothing left to do on this turn
                if done:
                    last, produced_at_last = time.monotonic(), self._produced()
                    turns.append(turns.pop(0))
            self._stop.wait(_LOOK_S)

    def _produced(self) -> int:
        """Groups of samples queued so far (a record each)."""
        return sum(self.b.queue.end_offsets(samples_topic(self.run_id)).values())

    def _reward_cache_errors_grew(self) -> Callable[[], bool]:
        """Whether the run's workers have reported reward cache errors since this call (they
        report after each batch)."""

        def errors() -> int:
            return sum(w.reward_cache_errors for w in self.b.state.worker_stats(self.run_id))

        before = errors()
        return lambda: errors() > before

    def _outage(
        self,
        server: str,
        lever: Callable[[], AbstractContextManager[object]],
        produced: int,
        iteration: int | None = None,
        met: Callable[[], bool] | None = None,
    ) -> None:
        """``server`` unresponsive for ``outage_s`` (the run goes on, or waits, meanwhile), and
        then, where ``met`` is given, until it says the run met the outage (or ``_MEET_MAX_S`` more)."""
        log.info("chaos: %s unresponsive for %.0f s", server, self.plan.outage_s)
        started = time.monotonic()
        with lever():
            self._stop.wait(self.plan.outage_s)  # cut short only when the monkey is stopped
            until = time.monotonic() + _MEET_MAX_S
            while met is not None and not met() and time.monotonic() < until and not self._stop.is_set():
                self._stop.wait(_LOOK_S)
        seconds = time.monotonic() - started
        self.tally.outages.append(Outage(server, seconds, self._produced() - produced, iteration))
        log.info("chaos: %s answers again after %.1f s", server, seconds)

    def _catch_publishing_jobs(self) -> None:
        """Preempt the first ``training_preemptions`` spot training jobs as their update begins;
        kill up to ``training_kills`` training jobs between publishing and committing; then make
        the object store unresponsive while the next ``object_store_outages`` jobs publish."""
        job: PodStatus | None = None
        listed_at = 0.0
        while not self._stop.is_set() and (
            self._preemptions_left()
            or len(self.tally.training_kills) < self.plan.training_kills
            or len(self.tally.of("object store")) < self.plan.object_store_outages
        ):
            if time.monotonic() - listed_at > 10 * _LOOK_S:  # the pods now and then, the object store often
                listed_at = time.monotonic()
                job = (
                    next(iter(_running(self.b.launcher.list(self.run_id), "training")), None)
                    if self._run_goes_on()
                    else None
                )
            if job is not None and self._preemptions_left() and self._updating(job):
                self._preempt_mid_update(job)
                job = None  # gone: the next listing finds its successor
            elif job is not None and self._publishing(job):
                if len(self.tally.training_kills) < self.plan.training_kills:
                    self._kill_between_publish_and_commit(job)
                else:
                    self._publish_through_outage(job)
            self._stop.wait(_WATCH_S)

    def _preemptions_left(self) -> bool:
        return len(self.tally.training_preemptions) + self.tally.preemptions_missed < self.plan.training_preemptions

    def _updating(self, job: PodStatus) -> bool:
        """Whether spot training ``job`` has just begun its update (its checkpoint's batch is
        stored; once per iteration)."""
        iteration = int(job.labels["iteration"])
        return (
            job.capacity_type == "spot"
            and job.pid is not None
            and iteration not in self._preempted
            and bool(self.b.objects.list(update_checkpoint_prefix(self.run_id, iteration)))
        )

    def _preempt_mid_update(self, job: PodStatus) -> None:
        """Reclaim ``job``'s node: by turns with the notice (SIGTERM; SIGKILL if still there after
        ``notice_s``) and without (SIGKILL). It counts if the job had not published by its end."""
        assert job.pid is not None
        iteration = int(job.labels["iteration"])
        self._preempted.add(iteration)
        notice = len(self.tally.training_preemptions) % 2 == 0
        _kill(job.pid, signal.SIGTERM if notice else signal.SIGKILL)
        if notice:
            _wait_ended(self.b, job.name, timeout_s=self.plan.notice_s)
            if not _ended(self.b, job.name):
                _kill(job.pid, signal.SIGKILL)
        _wait_ended(self.b, job.name)
        if self.b.objects.exists(result_key(self.run_id, iteration)):
            self.tally.preemptions_missed += 1
        else:
            self.tally.training_preemptions.append((iteration, "notice" if notice else "no notice"))
            log.info(
                "chaos: preempted spot training job %d mid-update (%s)", iteration, "notice" if notice else "no notice"
            )

    def _publishing(self, job: PodStatus) -> bool:
        """Whether ``job`` has just begun publishing its policy version (once per iteration, and not
        in an iteration preempted already: each disruption's effect stays its own)."""
        iteration = int(job.labels["iteration"])
        if (
            iteration in self._caught
            or iteration in self._preempted
            or job.pid is None
            or not self.b.objects.list(policy_prefix(self.run_id, iteration))
        ):
            return False
        self._caught.add(iteration)
        return True

    def _kill_between_publish_and_commit(self, job: PodStatus) -> None:
        """``job`` has begun publishing: withhold the queue's commits so that its own cannot
        happen, wait for its result, SIGKILL it, let commits through (module docstring)."""
        assert job.pid is not None
        iteration = int(job.labels["iteration"])
        key = result_key(self.run_id, iteration)
        committed: dict[int, int] | None = None
        with self.levers.withhold_commits():
            # From here until the block ends nobody commits: the job blocks in its commit.
            deadline = time.monotonic() + _LOCK_HOLD_MAX_S
            while not self.b.objects.exists(key):
                if time.monotonic() > deadline or _ended(self.b, job.name):
                    return  # it failed, or did not finish publishing in time: nothing to count
                time.sleep(0.002)
            time.sleep(_INTO_COMMIT_S)
            if _ended(self.b, job.name):
                return  # it ended by itself (its commit failed?): not a kill
            _kill(job.pid, signal.SIGKILL)
            _wait_ended(self.b, job.name)
            if self.levers.reads_while_withheld:  # before anyone else can commit for it
                committed = self.b.queue.committed(samples_topic(self.run_id), TRAINER_GROUP)
        if committed is None:
            # At once: committing for the dead job (the scheduler's) takes a group join first.
            committed = self.b.queue.committed(samples_topic(self.run_id), TRAINER_GROUP)
        # Committed already: the job did so before its commits were withheld.
        result = JobResult.from_json(self.b.objects.get_bytes(key))
        if any(committed.get(p, 0) < o for p, o in result.offsets.items()):
            self.tally.training_kills.append(iteration)
            log.info("chaos: SIGKILLed training job %d after it published v%d, before its commit", iteration, iteration)
        else:
            self.tally.training_missed += 1

    def _publish_through_outage(self, job: PodStatus) -> None:
        """``job`` has begun publishing: the object store unresponsive for ``outage_s``. It counts
        once the job's result shows that the job was still publishing when the outage began."""
        assert self.levers.object_store_outage is not None  # checked in __init__
        iteration = int(job.labels["iteration"])
        key = result_key(self.run_id, iteration)
        began = time.time()
        self._outage("object store", self.levers.object_store_outage, self._produced(), iteration)
        deadline = time.monotonic() + _RESULT_WAIT_S
        while not (
            self.b.objects.exists(key) or _ended(self.b, job.name) or self._stop.is_set() or time.monotonic() > deadline
        ):
            self._stop.wait(_LOOK_S)
        if not (self.b.objects.exists(key) and JobResult.from_json(self.b.objects.get_bytes(key)).ended_at > began):
            self.tally.outages.pop()  # it had published before (or never did): not an outage during publishing
            self.tally.outages_missed += 1


def _running(pods: list[PodStatus], role: str) -> list[PodStatus]:
    return [p for p in pods if p.role == role and p.phase == PodPhase.RUNNING]


def _computing(pid: int, looks: int = 2, apart_s: float = 0.005) -> bool:
    """Whether process ``pid``'s main thread is running or runnable at each of ``looks`` looks
    ``apart_s`` apart (``/proc/<pid>/stat``), not waiting on I/O or a lock: a rollout worker
    generating or scoring, not queueing its samples (the appends of a produce run for well under
    ``apart_s``, its wait for the acknowledgements sleeps)."""
    for look in range(looks):
        if look:
            time.sleep(apart_s)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state != "R":
            return False
    return True


def _kill(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, signum)


def _ended(backends: Backends, pod: str) -> bool:
    return all(p.phase != PodPhase.RUNNING for p in backends.launcher.list() if p.name == pod)


def _wait_ended(backends: Backends, pod: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _ended(backends, pod) and time.monotonic() < deadline:
        time.sleep(0.01)
