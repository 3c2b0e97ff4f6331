"""The embedded queue's consumer groups, as its SQLite file holds them: live members, the owner of
each partition (with an epoch bumped at each change, so a former owner's commits fail) and commits.
Read and rebalanced inside the caller's transaction (``services.ports.queue.sqlite_queue``)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from services.ports.queue.queue import UnknownTopicError


def partitions_of(conn: sqlite3.Connection, topic: str) -> int:
    row = conn.execute("SELECT partitions FROM topics WHERE topic = ?", (topic,)).fetchone()
    if row is None:
        raise UnknownTopicError(f"topic {topic!r} does not exist: create it with create_topic first")
    return int(row[0])


def end_offsets_of(conn: sqlite3.Connection, topic: str) -> dict[int, int]:
    partitions_of(conn, topic)
    return dict(conn.execute("SELECT partition_id, end_offset FROM log_ends WHERE topic = ?", (topic,)))


def committed_of(conn: sqlite3.Connection, topic: str, group: str) -> dict[int, int]:
    stored = dict(
        conn.execute("SELECT partition_id, next_offset FROM commits WHERE group_id = ? AND topic = ?", (group, topic))
    )
    return {p: stored.get(p, 0) for p in range(partitions_of(conn, topic))}


@dataclass(frozen=True)
class GroupView:
    """One snapshot of a group's membership, partition owners and commits on one topic."""

    partitions: int
    members: dict[str, tuple[str, float, float]]  # member id -> (instance, heartbeat_at, session_timeout_s)
    owners: dict[int, tuple[str | None, int]]  # partition -> (member id, epoch)
    committed: dict[int, int]

    @classmethod
    def read(cls, conn: sqlite3.Connection, topic: str, group: str) -> GroupView:
        key = (group, topic)
        members = conn.execute(
            "SELECT member_id, instance, heartbeat_at, session_timeout_s FROM members WHERE group_id = ? AND topic = ?",
            key,
        )
        owners = conn.execute("SELECT partition_id, member_id, epoch FROM owners WHERE group_id = ? AND topic = ?", key)
        return cls(
            partitions=partitions_of(conn, topic),
            members={m: (instance, beat, timeout) for m, instance, beat, timeout in members},
            owners={p: (m, epoch) for p, m, epoch in owners},
            committed=committed_of(conn, topic, group),
        )

    def owner(self, partition: int) -> tuple[str | None, int]:
        return self.owners.get(partition, (None, 0))

    def target_owners(self, now: float) -> dict[int, str | None]:
        """Partitions dealt round-robin over the sorted ids of the live members."""
        live = sorted(m for m, (_, beat, timeout) in self.members.items() if now - beat <= timeout)
        return {p: live[p % len(live)] if live else None for p in range(self.partitions)}

    def balanced(self, now: float) -> bool:
        return all(self.owner(p)[0] == m for p, m in self.target_owners(now).items())


def rebalance(conn: sqlite3.Connection, topic: str, group: str, now: float) -> GroupView:
    """Drop expired members and hand their partitions to the live ones; returns the new view."""
    conn.execute(
        "DELETE FROM members WHERE group_id = ? AND topic = ? AND ? - heartbeat_at > session_timeout_s",
        (group, topic, now),
    )
    view = GroupView.read(conn, topic, group)
    for partition, member in view.target_owners(now).items():
        current, epoch = view.owner(partition)
        if current != member:
            conn.execute(
                "INSERT INTO owners (group_id, topic, partition_id, member_id, epoch) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO UPDATE SET member_id = excluded.member_id, epoch = excluded.epoch",
                (group, topic, partition, member, epoch + 1),
            )
    return GroupView.read(conn, topic, group)
