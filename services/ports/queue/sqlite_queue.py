"""The embedded queue adapter: topics, partitions and consumer groups in one SQLite file that the
processes of one machine share (the API, the scheduler and the local pods)."""

from __future__ import annotations

import re
import sqlite3
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.ports.queue.queue import CommitFailedError, Consumer, MemberFencedError, Record
from services.ports.queue.sqlite_queue_groups import GroupView, committed_of, end_offsets_of, partitions_of, rebalance
from services.ports.sqlite_file import SqliteFile

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
# An idle poll re-reads the log this often while it waits for records.
_POLL_INTERVAL_S = 0.05
# A poll writes a heartbeat when this fraction of the session timeout has passed since the last.
_HEARTBEAT_FRACTION = 0.25

_SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (
    topic TEXT PRIMARY KEY,
    partitions INTEGER NOT NULL,
    round_robin INTEGER NOT NULL DEFAULT 0  -- the partition the next keyless record goes to
);
CREATE TABLE IF NOT EXISTS log_ends (
    topic TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    end_offset INTEGER NOT NULL,
    PRIMARY KEY (topic, partition_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records (
    topic TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    log_offset INTEGER NOT NULL,
    key BLOB,
    value BLOB NOT NULL,
    timestamp REAL NOT NULL,
    PRIMARY KEY (topic, partition_id, log_offset)
);
CREATE TABLE IF NOT EXISTS commits (
    group_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY (group_id, topic, partition_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS members (
    group_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    member_id TEXT NOT NULL,
    instance TEXT NOT NULL,  -- the consumer object holding the id, so a newer one can fence an older one
    heartbeat_at REAL NOT NULL,
    session_timeout_s REAL NOT NULL,
    PRIMARY KEY (group_id, topic, member_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS owners (
    group_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    member_id TEXT,  -- NULL while the group has no live member
    epoch INTEGER NOT NULL,  -- bumped whenever the owner changes, so a former owner's commits fail
    PRIMARY KEY (group_id, topic, partition_id)
) WITHOUT ROWID
"""


def _partition_for_key(key: bytes, partitions: int) -> int:
    # crc32 rather than hash(): Python salts hash() per process, and all producers must agree.
    return zlib.crc32(key) % partitions


class _SqliteConsumer:
    """A group member; its read positions live in this object, its membership in the file."""

    def __init__(
        self,
        file: SqliteFile,
        topic: str,
        group: str,
        member_id: str,
        session_timeout_s: float,
        on_close: Callable[[_SqliteConsumer], None],
    ) -> None:
        self._file = file
        self._topic = topic
        self._group = group
        self._member_id = member_id
        self._session_timeout_s = session_timeout_s
        self._on_close = on_close
        self._instance = uuid.uuid4().hex
        self._positions: dict[int, int] = {}  # owned partition -> next offset to read
        self._epochs: dict[int, int] = {}  # owned partition -> owner epoch when this member got it
        self._heartbeat_at = float("-inf")
        self._rotation = 0
        self._closed = False
        self._sync(join=True)

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        self._check_open()
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        deadline = time.monotonic() + timeout_s
        while True:
            self._sync(join=False)
            records = self._fetch(max_records)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            time.sleep(min(_POLL_INTERVAL_S, remaining))

    def commit(self, offsets: Mapping[int, int]) -> None:
        self._check_open()
        now = time.time()
        with self._file.write() as conn:
            view = self._heartbeat(conn, now, take_over=False, rejoin=False)
            ends = end_offsets_of(conn, self._topic)
            for partition, offset in offsets.items():
                if partition not in ends or not 0 <= offset <= ends[partition]:
                    raise ValueError(
                        f"cannot commit offset {offset} for partition {partition} of topic {self._topic!r}:"
                        f" the log ends are {ends}; commit next_offsets(records) of records this consumer polled"
                    )
            lost = sorted(p for p in offsets if view.owner(p) != (self._member_id, self._epochs.get(p)))
            if not lost:
                conn.executemany(
                    "INSERT INTO commits (group_id, topic, partition_id, next_offset) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT DO UPDATE SET next_offset = excluded.next_offset",
                    [(self._group, self._topic, p, o) for p, o in offsets.items()],
                )
        self._heartbeat_at = now
        self._adopt(view)
        if lost:
            raise CommitFailedError(
                f"member {self._member_id!r} of group {self._group!r} no longer owns partitions {lost} of topic"
                f" {self._topic!r} (the group rebalanced, e.g. after a {self._session_timeout_s} s session timeout"
                " without a poll); nothing was committed and the new owner gets those records again"
            )

    def assignment(self) -> set[int]:
        return set(self._epochs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._file.write() as conn:
            # Only the row's holder may remove it: a fenced consumer must not evict its successor.
            conn.execute(
                "DELETE FROM members WHERE group_id = ? AND topic = ? AND member_id = ? AND instance = ?",
                (self._group, self._topic, self._member_id, self._instance),
            )
            if conn.execute("SELECT 1 FROM topics WHERE topic = ?", (self._topic,)).fetchone():
                rebalance(conn, self._topic, self._group, time.time())
        self._positions, self._epochs = {}, {}
        self._on_close(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"consumer {self._member_id!r} is closed; open a new one with Queue.consumer")

    def _sync(self, *, join: bool) -> None:
        """Heartbeat when due, follow any rebalance, and set read positions for gained partitions."""
        now = time.time()
        if not join and now - self._heartbeat_at < self._session_timeout_s * _HEARTBEAT_FRACTION:
            # Fast path: a read-only check; most polls find the group unchanged and write nothing.
            with self._file.read() as conn:
                view = GroupView.read(conn, self._topic, self._group)
            holder = view.members.get(self._member_id)
            if holder is not None and holder[0] == self._instance and view.balanced(now):
                self._adopt(view)
                return
        with self._file.write() as conn:
            view = self._heartbeat(conn, now, take_over=join, rejoin=True)
        self._heartbeat_at = now
        self._adopt(view)

    def _heartbeat(self, conn: sqlite3.Connection, now: float, *, take_over: bool, rejoin: bool) -> GroupView:
        """Record this member as alive and rebalance the group; returns the group after it.

        ``take_over``: a consumer holding this member id is replaced (joining); otherwise its
        presence means this consumer was replaced. ``rejoin``: a member that was dropped (its
        session timed out and a rebalance removed it) joins again. Polls rejoin; commits do not,
        so that a late commit cannot pull partitions back from the members that took them over.
        A member past its timeout but not yet removed was replaced by no one: its partitions
        kept their epochs, so its heartbeat simply resumes.
        """
        key = (self._group, self._topic, self._member_id)
        row = conn.execute(
            "SELECT instance FROM members WHERE group_id = ? AND topic = ? AND member_id = ?", key
        ).fetchone()
        if row is not None and row[0] != self._instance:
            if not take_over:
                raise MemberFencedError(
                    f"another consumer joined group {self._group!r} of topic {self._topic!r} as member"
                    f" {self._member_id!r} and took over its partitions; close this consumer"
                )
            # Taking over a member id: bump the epochs so the previous holder's commits fail.
            conn.execute("UPDATE owners SET epoch = epoch + 1 WHERE group_id = ? AND topic = ? AND member_id = ?", key)
        elif row is None and not rejoin:
            return rebalance(conn, self._topic, self._group, now)
        conn.execute(
            "INSERT INTO members (group_id, topic, member_id, instance, heartbeat_at, session_timeout_s)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET instance = excluded.instance,"
            " heartbeat_at = excluded.heartbeat_at, session_timeout_s = excluded.session_timeout_s",
            (*key, self._instance, now, self._session_timeout_s),
        )
        return rebalance(conn, self._topic, self._group, now)

    def _adopt(self, view: GroupView) -> None:
        """Take the owned partitions from ``view``; a partition gained (or regained) restarts from the commit."""
        owned = {p: epoch for p, (m, epoch) in view.owners.items() if m == self._member_id}
        self._positions = {
            p: self._positions[p] if self._epochs.get(p) == epoch else view.committed[p] for p, epoch in owned.items()
        }
        self._epochs = owned

    def _fetch(self, max_records: int) -> list[Record]:
        partitions = sorted(self._positions)
        if not partitions:
            return []
        # Start at a different partition each poll so a busy one cannot starve the others.
        start = self._rotation % len(partitions)
        self._rotation += 1
        records: list[Record] = []
        with self._file.read() as conn:
            for partition in partitions[start:] + partitions[:start]:
                room = max_records - len(records)
                if room == 0:
                    break
                rows = conn.execute(
                    "SELECT log_offset, key, value, timestamp FROM records"
                    " WHERE topic = ? AND partition_id = ? AND log_offset >= ? ORDER BY log_offset LIMIT ?",
                    (self._topic, partition, self._positions[partition], room),
                ).fetchall()
                records.extend(Record(self._topic, partition, o, k, v, ts) for o, k, v, ts in rows)
                if rows:
                    self._positions[partition] = rows[-1][0] + 1
        return records


class SqliteQueue:
    """The queue in one SQLite file, shared by every process of one machine that opens it.

    Records are fsynced before ``produce`` returns (WAL, synchronous=FULL). Group membership
    lives in the file: live members are those that polled within their session timeout, and
    partitions are dealt round-robin over their sorted ids, recomputed at every poll. A member
    that stops polling (a SIGKILLed worker) loses its partitions once its session times out, and
    the new owner resumes from the committed offset.

    Open it after any ``fork``: a connection must not be shared by two processes.
    """

    def __init__(self, path: Path) -> None:
        self._file = SqliteFile(path, schema=_SCHEMA, synchronous="FULL")
        self._consumers: set[_SqliteConsumer] = set()

    def create_topic(self, topic: str, partitions: int) -> None:
        if not _TOPIC_NAME.fullmatch(topic):
            raise ValueError(f"topic name {topic!r} is invalid: use 1-249 of the characters A-Z a-z 0-9 . _ -")
        if partitions < 1:
            raise ValueError(f"a topic needs at least one partition, got {partitions}")
        with self._file.write() as conn:
            row = conn.execute("SELECT partitions FROM topics WHERE topic = ?", (topic,)).fetchone()
            if row is not None:
                if row[0] != partitions:
                    raise ValueError(
                        f"topic {topic!r} already exists with {row[0]} partitions, not {partitions}:"
                        " delete it first or ask for the same number"
                    )
                return
            conn.execute("INSERT INTO topics (topic, partitions) VALUES (?, ?)", (topic, partitions))
            conn.executemany(
                "INSERT INTO log_ends (topic, partition_id, end_offset) VALUES (?, ?, 0)",
                [(topic, p) for p in range(partitions)],
            )

    def delete_topic(self, topic: str) -> None:
        with self._file.write() as conn:
            for table in ("topics", "log_ends", "records", "commits", "members", "owners"):
                conn.execute(f"DELETE FROM {table} WHERE topic = ?", (topic,))

    def produce(self, topic: str, values: Sequence[bytes], *, keys: Sequence[bytes | None] | None = None) -> None:
        if keys is not None and len(keys) != len(values):
            raise ValueError(f"got {len(keys)} keys for {len(values)} values; pass one key per value, or none")
        for value in values:
            if not isinstance(value, bytes):
                raise TypeError(f"record values must be bytes, got {type(value).__name__}; encode them first")
        now = time.time()
        with self._file.write() as conn:
            partitions = partitions_of(conn, topic)
            (round_robin,) = conn.execute("SELECT round_robin FROM topics WHERE topic = ?", (topic,)).fetchone()
            ends = end_offsets_of(conn, topic)
            rows = []
            for value, key in zip(values, keys if keys is not None else [None] * len(values), strict=True):
                if key is None:
                    partition, round_robin = round_robin % partitions, round_robin + 1
                else:
                    partition = _partition_for_key(key, partitions)
                rows.append((topic, partition, ends[partition], key, value, now))
                ends[partition] += 1
            conn.executemany(
                "INSERT INTO records (topic, partition_id, log_offset, key, value, timestamp)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            conn.executemany(
                "UPDATE log_ends SET end_offset = ? WHERE topic = ? AND partition_id = ?",
                [(end, topic, p) for p, end in ends.items()],
            )
            conn.execute("UPDATE topics SET round_robin = ? WHERE topic = ?", (round_robin % partitions, topic))

    def consumer(self, topic: str, group: str, *, member_id: str, session_timeout_s: float = 10.0) -> Consumer:
        if session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s}")
        consumer = _SqliteConsumer(
            self._file, topic, group, member_id, session_timeout_s, on_close=self._consumers.discard
        )
        self._consumers.add(consumer)
        return consumer

    def end_offsets(self, topic: str) -> dict[int, int]:
        with self._file.read() as conn:
            return end_offsets_of(conn, topic)

    def committed(self, topic: str, group: str) -> dict[int, int]:
        with self._file.read() as conn:
            return committed_of(conn, topic, group)

    def backlog(self, topic: str, group: str) -> int:
        with self._file.read() as conn:
            committed = committed_of(conn, topic, group)
            return sum(end - committed[p] for p, end in end_offsets_of(conn, topic).items())

    def close(self) -> None:
        for consumer in list(self._consumers):
            consumer.close()
        self._file.close()
