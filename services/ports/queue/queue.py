"""The queue port: a durable, partitioned log with consumer groups (Kafka semantics).

Delivery is at-least-once. A consumer commits the offsets of what it has finished; after a
crash, a close or a rebalance the group resumes from the committed offsets, so records read
but not committed are delivered again (consumers drop duplicates by their own ids).

Adapters: ``services.ports.queue.sqlite_queue.SqliteQueue`` (one file shared by the processes of
one machine) and ``services.ports.queue.kafka_queue.KafkaQueue`` (Apache Kafka); both pass the same
contract tests (tests/services/ports/queue/test_queue_contract.py), Kafka against a real
Kafka-protocol broker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a topic partition; ``offset`` is its position in that partition."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float  # unix seconds when produced


class UnknownTopicError(LookupError):
    """The topic does not exist; ``create_topic`` makes it."""


class CommitFailedError(Exception):
    """The commit named a partition this member no longer owns: the group rebalanced.

    Nothing of the commit was stored; the partition's new owner is redelivered its records.
    """


class MemberFencedError(CommitFailedError):
    """A newer consumer joined with this consumer's member id and took over its partitions.

    This is how a restarted worker replaces its predecessor without waiting for the session
    timeout (Kafka's static membership); the older consumer must stop and be closed.
    """


class Consumer(Protocol):
    """A member of a consumer group, reading the partitions the group assigns to it."""

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout_s`` for the first.

        Each call heartbeats the membership: a member that does not poll for its session
        timeout loses its partitions to the other members.
        """
        ...

    def commit(self, offsets: Mapping[int, int]) -> None:
        """Store ``partition -> next offset to read`` (last offset + 1) for the group.

        Raises CommitFailedError, storing nothing, if any partition is no longer this member's.
        """
        ...

    def assignment(self) -> set[int]:
        """The partitions this member owned at its last poll (or join)."""
        ...

    def close(self) -> None:
        """Leave the group now: its partitions go to the other members at once."""
        ...


class Queue(Protocol):
    def create_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic``; a no-op if it exists with the same number of partitions."""
        ...

    def delete_topic(self, topic: str) -> None:
        """Delete the topic, its records and its groups' offsets; a no-op if it does not exist."""
        ...

    def produce(self, topic: str, values: Sequence[bytes], *, keys: Sequence[bytes | None] | None = None) -> None:
        """Append ``values``; returns only once all are durable (acks=all).

        A record's partition is a stable hash of its key, so one key's records stay in order;
        records without a key are dealt round-robin.
        """
        ...

    def consumer(self, topic: str, group: str, *, member_id: str, session_timeout_s: float = 10.0) -> Consumer:
        """Join ``group`` on ``topic`` as ``member_id``; a live consumer with the same id is fenced."""
        ...

    def end_offsets(self, topic: str) -> dict[int, int]:
        """partition -> offset the next produced record will get."""
        ...

    def committed(self, topic: str, group: str) -> dict[int, int]:
        """partition -> the group's committed offset; 0 for partitions never committed."""
        ...

    def backlog(self, topic: str, group: str) -> int:
        """Records produced but not yet committed by ``group``: sum of end - committed."""
        ...

    def close(self) -> None:
        """Close the client, and with it every consumer it opened (they leave their groups)."""
        ...


def next_offsets(records: Iterable[Record]) -> dict[int, int]:
    """The commit for ``records``: partition -> highest offset + 1."""
    offsets: dict[int, int] = {}
    for record in records:
        offsets[record.partition] = max(offsets.get(record.partition, 0), record.offset + 1)
    return offsets


# Kafka's rule for topic names, checked here too so a name that works embedded works on Kafka.
