"""Reading the trainer group's sample backlog: how many samples wait (the scheduler's trigger and
``/metrics``), what a training job takes as its batch, and what the scheduler counts as dropped
when a run ends. No torch: the scheduler and the API import this."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.domain.names import TRAINER_GROUP, TRAINER_MEMBER, samples_topic
from services.ports.queue.queue import Consumer, Queue, Record, next_offsets

# The job polls once at start and commits minutes later: a session this long keeps its membership.
TRAINER_SESSION_S = 24 * 3600.0
# How long reading the backlog may go without a record before the job gives up (and is retried).
READ_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class SampleBacklog:
    """A run's sample topic as the trainer group stands on it."""

    queued: int  # samples queued and not yet committed by the trainer group
    produced: int  # every sample ever queued
    committed: int  # the trainer group's committed offsets, summed over partitions (records, not samples)


def sample_backlog(queue: Queue, run_id: str, group_size: int) -> SampleBacklog:
    """The run's sample backlog now; each record of its topic is a group of ``group_size`` samples.

    One read of the commits, then one of the end offsets: a job committing between two reads of
    the backlog made it lack the job's batch while the commits still showed the job holding it (the
    scheduler then counted that batch twice, and stopped a pool the run needed).
    """
    topic = samples_topic(run_id)
    committed = queue.committed(topic, TRAINER_GROUP)
    end = queue.end_offsets(topic)
    return SampleBacklog(
        queued=group_size * sum(offset - committed.get(partition, 0) for partition, offset in end.items()),
        produced=group_size * sum(end.values()),
        committed=sum(committed.values()),
    )


def take_batch(records: Sequence[Record], groups: int) -> tuple[list[Record], dict[int, int]]:
    """The oldest ``groups`` records (each a GRPO group: ``contracts.samples.encode_group``) and
    the offsets committing them.

    Oldest by produce time across partitions, in offset order within each, so that what is
    taken from a partition is a prefix of it (a commit only moves forward) even where producers'
    clocks disagree.
    """
    by_partition: dict[int, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_partition.setdefault(r.partition, []).append(r)
    oldest_first = heapq.merge(*by_partition.values(), key=lambda r: (r.timestamp, r.partition))
    taken = list(itertools.islice(oldest_first, groups))
    return taken, next_offsets(taken)


def trainer_consumer(queue: Queue, run_id: str) -> Consumer:
    return queue.consumer(
        samples_topic(run_id), TRAINER_GROUP, member_id=TRAINER_MEMBER, session_timeout_s=TRAINER_SESSION_S
    )


def read_backlog(
    queue: Queue, consumer: Consumer, run_id: str, timeout_s: float = READ_TIMEOUT_S
) -> tuple[list[Record], dict[int, int]]:
    """Every record queued for the trainer group now, and the offsets that commit them.

    Read until each partition's position reaches its end offset as measured first (records
    after it are the next job's), not until a count: a partition whose offsets have a gap (a
    broker may leave some offsets without a record) still completes. A read that gets nowhere
    for ``timeout_s`` raises ``BacklogReadTimeout`` rather than keep an on-demand GPU waiting.
    """
    topic = samples_topic(run_id)
    end = queue.end_offsets(topic)
    committed = queue.committed(topic, TRAINER_GROUP)
    records: list[Record] = []
    positions = {p: committed.get(p, 0) for p in end}
    deadline = time.monotonic() + timeout_s
    while behind := {p: (positions[p], end[p]) for p in end if positions[p] < end[p]}:
        if time.monotonic() > deadline:
            raise BacklogReadTimeout(
                f"the trainer group read no further in {timeout_s:.0f} s; partition: (position, end offset) {behind}"
            )
        for r in consumer.poll(1000, timeout_s=1.0):
            if r.offset < end[r.partition] and r.offset >= positions[r.partition]:
                records.append(r)
                positions[r.partition] = r.offset + 1
                deadline = time.monotonic() + timeout_s  # a timeout without progress, not in all
    return records, {p: o for p, o in positions.items() if o > committed.get(p, 0)}


class BacklogReadTimeout(TimeoutError):
    """The queue did not deliver the records its offsets say are there (module: read_backlog)."""
