"""What the chaos monkey (``services.tooling.chaos.Chaos``) is asked to break (``ChaosPlan``), the levers
it pulls on the servers (``Levers``; ``embedded_levers`` for the embedded backends), and what it
did (``ChaosTally``, ``Outage``). Control plane only: no torch.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.core.config import Settings


@dataclass(frozen=True)
class ChaosPlan:
    """How much to break. Disruptions of workers, the scheduler, the queue and the reward cache
    take turns, ``pause_s`` apart at least; a training job caught publishing is killed, up to
    ``training_kills``, and the jobs caught after those publish through an object store outage,
    up to ``object_store_outages``. A run training on spot capacity has its first
    ``training_preemptions`` jobs preempted as their update begins, by turns with the provider's
    notice (SIGTERM, SIGKILL after ``notice_s``) and without (SIGKILL). Outages need the
    ``Levers`` of real servers."""

    worker_kills: int = 3
    training_kills: int = 1
    training_preemptions: int = 0  # spot training jobs preempted mid-update, with a notice and without by turns
    notice_s: float = 30.0
    scheduler_restarts: int = 2  # alternately after a SIGKILL and after a SIGTERM
    queue_outages: int = 0  # the queue's brokers unresponsive for outage_s
    reward_cache_outages: int = 0  # the reward cache unresponsive for outage_s, while rollout workers run
    object_store_outages: int = 0  # the object store unresponsive for outage_s while a job publishes
    outage_s: float = 10.0
    pause_s: float = 5.0
    seed: int = 0


@dataclass(frozen=True)
class Levers:
    """How the monkey makes the backends fail: each a context manager, the failure lasting for its block.

    ``withhold_commits``: no queue commit gets through, and one that a process was blocked in
    when it died never does (embedded: the queue file's write lock; Kafka: a cut link between the
    processes and the brokers, which loses a dead process's unsent bytes, as a lost machine
    does). ``reads_while_withheld``: whether the queue still answers reads meanwhile (the
    embedded queue does: WAL readers go on under the write lock), so the monkey can check a
    killed job's commit before anyone else can commit for it.
    ``queue_outage``, ``reward_cache_outage``, ``object_store_outage``: that server unresponsive
    (hung or partitioned, as SIGSTOP and SIGCONT of a test server's process make it); None where
    the monkey has no such lever.
    """

    withhold_commits: Callable[[], AbstractContextManager[object]]
    reads_while_withheld: bool = False
    queue_outage: Callable[[], AbstractContextManager[object]] | None = None
    reward_cache_outage: Callable[[], AbstractContextManager[object]] | None = None
    object_store_outage: Callable[[], AbstractContextManager[object]] | None = None


def embedded_levers(settings: Settings) -> Levers:
    """The embedded backends' one lever: the queue file's write lock (module docstring)."""
    queue_file = settings.home.resolve() / "queue.db"  # where services.ports.wiring.open_queue keeps it
    return Levers(withhold_commits=lambda: _queue_write_lock(queue_file), reads_while_withheld=True)


@dataclass(frozen=True)
class Outage:
    """One server made unresponsive by the monkey while the run went on."""

    server: str  # "queue", "reward cache" or "object store"
    seconds: float
    groups_during: int  # groups of samples queued meanwhile (counted when the queue answers again)
    iteration: int | None = None  # the training job publishing meanwhile (object store outages)


@dataclass
class ChaosTally:
    """What the monkey did."""

    worker_kills: list[str] = field(default_factory=list)  # pods SIGKILLed
    training_kills: list[int] = field(default_factory=list)  # iterations killed after publishing, before committing
    training_missed: int = 0  # jobs caught publishing that committed before the kill (nothing to count)
    # (iteration, "notice" or "no notice") of spot training jobs preempted during their update
    training_preemptions: list[tuple[int, str]] = field(default_factory=list)
    preemptions_missed: int = 0  # jobs preempted too late: they had published (nothing to count)
    scheduler_kills: int = 0  # SIGKILLs
    scheduler_stops: int = 0  # SIGTERMs (a clean stop, the lease released)
    scheduler_starts: int = 0
    outages: list[Outage] = field(default_factory=list)
    outages_missed: int = 0  # object store outages that began after the job had published (nothing to count)

    def of(self, server: str) -> list[Outage]:
        return [o for o in self.outages if o.server == server]

    def line(self) -> str:
        outages = "; ".join(
            f"{o.server} unresponsive {o.seconds:.1f} s ({o.groups_during} groups of samples queued meanwhile"
            + (f", job {o.iteration} publishing)" if o.iteration is not None else ")")
            for o in self.outages
        )
        return (
            f"chaos: {len(self.worker_kills)} rollout workers SIGKILLed; training jobs SIGKILLed between publish and "
            f"commit: iterations {self.training_kills or 'none'} ({self.training_missed} missed); "
            + (
                "spot training jobs preempted mid-update: "
                + ", ".join(f"iteration {i} ({how})" for i, how in self.training_preemptions)
                + f" ({self.preemptions_missed} missed); "
                if self.training_preemptions or self.preemptions_missed
                else ""
            )
            + "scheduler "
            f"SIGKILLed {self.scheduler_kills}x, SIGTERMed {self.scheduler_stops}x, started {self.scheduler_starts}x"
            + (f"; outages: {outages}" if outages else "")
            + (f" ({self.outages_missed} missed)" if self.outages_missed else "")
        )


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
