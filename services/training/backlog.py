"""Reading the trainer group's sample backlog: what a training job takes as its batch, and what
the scheduler counts as dropped when a run ends. No torch: the scheduler imports this."""

from __future__ import annotations

from collections.abc import Sequence

from services.backends.queue import Consumer, Queue, Record, next_offsets
from services.names import TRAINER_GROUP, TRAINER_MEMBER, samples_topic

# The job polls once at start and commits minutes later: a session this long keeps its membership.
TRAINER_SESSION_S = 24 * 3600.0


def take_batch(records: Sequence[Record], batch_samples: int, group_size: int) -> tuple[list[Record], dict[int, int]]:
    """The oldest ``batch_samples`` records, extended to whole groups, and the offsets committing them.

    Taken in produce order, so the records of each partition are a prefix (a commit can only
    move forward); a group's records are contiguous in one partition (they share its key).
    """
    taken: list[Record] = []
    for r in sorted(records, key=lambda r: (r.timestamp, r.partition, r.offset)):
        if len(taken) >= batch_samples and len(taken) % group_size == 0:
            break
        taken.append(r)
    return taken, next_offsets(taken)


def trainer_consumer(queue: Queue, run_id: str) -> Consumer:
    return queue.consumer(
        samples_topic(run_id), TRAINER_GROUP, member_id=TRAINER_MEMBER, session_timeout_s=TRAINER_SESSION_S
    )


def read_backlog(queue: Queue, consumer: Consumer, run_id: str) -> tuple[list[Record], dict[int, int]]:
    """Every record queued for the trainer group now, and the offsets that commit them."""
    topic = samples_topic(run_id)
    end = queue.end_offsets(topic)
    committed = queue.committed(topic, TRAINER_GROUP)
    want = sum(end[p] - committed.get(p, 0) for p in end)
    records: list[Record] = []
    positions = dict(committed)
    while len(records) < want:
        for r in consumer.poll(1000, timeout_s=1.0):
            if r.offset < end[r.partition]:
                records.append(r)
                positions[r.partition] = r.offset + 1
    return records, {p: o for p, o in positions.items() if o > committed.get(p, 0)}
