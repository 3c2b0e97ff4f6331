"""The contract every Queue adapter passes; production adapters join ADAPTERS."""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.ports.queue.queue import (
    CommitFailedError,
    Consumer,
    MemberFencedError,
    Queue,
    Record,
    UnknownTopicError,
    next_offsets,
)
from services.ports.queue.sqlite_queue import SqliteQueue

PARTITIONS = 4
SILENT_SESSION_S = 10.0

# adapter name -> (the test's request, for a server fixture; a folder for its state) -> a function
# opening a client on the same backing store
ADAPTERS: dict[str, Callable[[pytest.FixtureRequest, Path], Callable[[], Queue]]] = {
    "sqlite": lambda request, root: lambda: SqliteQueue(root / "queue.db"),
    "kafka": lambda request, root: request.getfixturevalue("kafka_broker").open_queue,  # tests/servers/kafka.py
}


@pytest.fixture(params=sorted(ADAPTERS))
def open_queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Queue]]:
    """Opens clients of one backing store (so a test can close one and reopen); closes them all at the end."""
    make = ADAPTERS[request.param](request, tmp_path)
    opened: list[Queue] = []

    def open_() -> Queue:
        opened.append(make())
        return opened[-1]

    yield open_
    for q in opened:
        q.close()


@pytest.fixture
def queue(open_queue: Callable[[], Queue]) -> Queue:
    return open_queue()


@pytest.fixture
def topic(queue: Queue) -> str:
    # Unique per test: a real broker outlives the test.
    name = f"t-{uuid.uuid4().hex[:12]}"
    queue.create_topic(name, PARTITIONS)
    return name


def drain(consumer: Consumer, want: int, timeout_s: float = 30.0) -> list[Record]:
    """Poll until ``want`` records arrived (or fail after ``timeout_s``)."""
    got: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want:
        assert time.monotonic() < deadline, f"got {len(got)} of {want} records in {timeout_s} s"
        got += consumer.poll(want - len(got), timeout_s=0.2)
    return got


def values(records: list[Record]) -> list[bytes]:
    return [r.value for r in records]


def produce_numbered(queue: Queue, topic: str, n: int, start: int = 0) -> list[bytes]:
    sent = [f"v{i}".encode() for i in range(start, start + n)]
    queue.produce(topic, sent)
    return sent


def test_records_come_back_in_order_per_partition(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 40)
    got = drain(queue.consumer(topic, "g", member_id="m"), 40)

    assert sorted(values(got)) == sorted(sent)
    by_partition: dict[int, list[Record]] = defaultdict(list)
    for r in got:
        by_partition[r.partition].append(r)
    # Keyless records are dealt round-robin, so every partition got some.
    assert set(by_partition) == set(range(PARTITIONS))
    for partition, records in by_partition.items():
        assert [r.offset for r in records] == list(range(len(records))), partition
        assert [sent.index(r.value) for r in records] == sorted(sent.index(r.value) for r in records)
        assert all(r.topic == topic and r.key is None and r.timestamp > 0 for r in records)


def test_a_key_always_goes_to_the_same_partition(queue: Queue, topic: str) -> None:
    keys = [f"key-{i % 10}".encode() for i in range(50)]
    queue.produce(topic, [f"first-{i}".encode() for i in range(50)], keys=keys)
    queue.produce(topic, [f"second-{i}".encode() for i in range(50)], keys=keys)
    got = drain(queue.consumer(topic, "g", member_id="m"), 100)

    partitions_of_key: dict[bytes | None, set[int]] = defaultdict(set)
    for r in got:
        partitions_of_key[r.key].add(r.partition)
    assert set(partitions_of_key) == set(keys)
    assert all(len(p) == 1 for p in partitions_of_key.values()), partitions_of_key
    # One key's records keep their produce order.
    for key in set(keys):
        mine = sorted((r for r in got if r.key == key), key=lambda r: r.offset)
        order = [int(r.value.split(b"-")[1]) + (50 if r.value.startswith(b"second") else 0) for r in mine]
        assert order == sorted(order)


def test_a_new_consumer_resumes_after_the_commit(queue: Queue, topic: str) -> None:
    produce_numbered(queue, topic, 20)
    first = queue.consumer(topic, "g", member_id="m1")
    got = drain(first, 20)
    first.commit(dict.fromkeys(range(PARTITIONS), 2))  # records at offsets 0 and 1 are done
    first.close()

    again = drain(queue.consumer(topic, "g", member_id="m2"), 12)

    assert sorted(values(again)) == sorted(r.value for r in got if r.offset >= 2)
    assert queue.committed(topic, "g") == dict.fromkeys(range(PARTITIONS), 2)


def test_uncommitted_records_are_redelivered_after_close(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 20)
    first = queue.consumer(topic, "g", member_id="m1")
    drain(first, 20)
    first.close()

    assert sorted(values(drain(queue.consumer(topic, "g", member_id="m2"), 20))) == sorted(sent)


def test_a_silent_member_loses_its_partitions_after_its_session_timeout(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 20)
    # A session longer than a second member's join takes (Kafka: a rebalance; up to 2.5 s on the
    # test broker when idle, and 5 s was once too short beside the rest of the suite).
    silent = queue.consumer(topic, "g", member_id="a-silent", session_timeout_s=SILENT_SESSION_S)
    taken = drain(silent, 20)  # alone in the group: it gets everything, then stops polling
    survivor = queue.consumer(topic, "g", member_id="b-survivor", session_timeout_s=SILENT_SESSION_S)
    held = survivor.assignment()
    assert held != set(range(PARTITIONS)), "the silent member's session has not timed out yet"

    own = drain(survivor, sum(1 for r in taken if r.partition in held))
    rest = drain(survivor, 20 - len(own))  # only once the silent member's session timed out
    got = own + rest

    assert {r.partition for r in own} <= held
    assert {r.partition for r in rest} == set(range(PARTITIONS)) - held
    assert sorted(values(got)) == sorted(sent)
    assert survivor.assignment() == set(range(PARTITIONS))
    with pytest.raises(CommitFailedError):
        silent.commit(next_offsets(taken))
    survivor.commit(next_offsets(got))
    assert queue.backlog(topic, "g") == 0


def test_a_member_late_past_its_session_commits_if_no_one_took_its_partitions(queue: Queue, topic: str) -> None:
    produce_numbered(queue, topic, 8)
    slow = queue.consumer(topic, "g", member_id="slow", session_timeout_s=0.5)
    got = drain(slow, 8)
    time.sleep(1.0)  # a long batch: the session timed out, but no other member noticed

    slow.commit(next_offsets(got))
    assert queue.backlog(topic, "g") == 0


def test_two_members_split_the_partitions_and_share_no_record(queue: Queue, topic: str) -> None:
    a = queue.consumer(topic, "g", member_id="a")
    b = queue.consumer(topic, "g", member_id="b")
    deadline = time.monotonic() + 30
    # Both join before anything is produced: neither can have read a record of the other's partitions.
    while not (
        a.assignment()
        and b.assignment()
        and not a.assignment() & b.assignment()
        and a.assignment() | b.assignment() == set(range(PARTITIONS))
    ):
        assert time.monotonic() < deadline, "the group never settled"
        a.poll(1, timeout_s=0.1)
        b.poll(1, timeout_s=0.1)
    sent = produce_numbered(queue, topic, 40)

    seen: dict[str, list[bytes]] = {"a": [], "b": []}
    deadline = time.monotonic() + 30
    while len(seen["a"]) + len(seen["b"]) < 40:
        assert time.monotonic() < deadline
        for name, consumer in (("a", a), ("b", b)):
            records = consumer.poll(7, timeout_s=0.1)
            consumer.commit(next_offsets(records))
            seen[name] += values(records)

    assert seen["a"] and seen["b"]
    assert not set(seen["a"]) & set(seen["b"])
    assert Counter(seen["a"] + seen["b"]) == Counter(sent)
    assert queue.backlog(topic, "g") == 0


def test_backlog_is_end_minus_committed(queue: Queue, topic: str) -> None:
    assert queue.backlog(topic, "g") == 0
    assert queue.end_offsets(topic) == dict.fromkeys(range(PARTITIONS), 0)
    assert queue.committed(topic, "g") == dict.fromkeys(range(PARTITIONS), 0)
    produce_numbered(queue, topic, 10)
    assert sum(queue.end_offsets(topic).values()) == 10
    assert queue.backlog(topic, "g") == 10

    consumer = queue.consumer(topic, "g", member_id="m")
    got = drain(consumer, 10)
    done = [r for r in got if r.offset == 0]
    consumer.commit(next_offsets(done))

    assert queue.committed(topic, "g") == dict.fromkeys(range(PARTITIONS), 1)
    assert queue.backlog(topic, "g") == 10 - len(done)
    assert queue.backlog(topic, "other-group") == 10


def test_topics_are_isolated(queue: Queue, topic: str) -> None:
    other = f"{topic}-other"
    queue.create_topic(other, 2)
    sent = produce_numbered(queue, topic, 8)
    sent_other = produce_numbered(queue, other, 3, start=100)

    assert sorted(values(drain(queue.consumer(topic, "g", member_id="m"), 8))) == sorted(sent)
    assert sorted(values(drain(queue.consumer(other, "g", member_id="m"), 3))) == sorted(sent_other)
    assert sum(queue.end_offsets(other).values()) == 3
    assert set(queue.end_offsets(other)) == {0, 1}


def test_each_group_sees_every_record(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 12)
    for group in ("g1", "g2"):
        consumer = queue.consumer(topic, group, member_id="m")
        got = drain(consumer, 12)
        consumer.commit(next_offsets(got))
        assert sorted(values(got)) == sorted(sent)
    assert queue.backlog(topic, "g1") == queue.backlog(topic, "g2") == 0


def test_records_and_commits_survive_reopening(open_queue: Callable[[], Queue]) -> None:
    queue = open_queue()
    topic = f"t-{uuid.uuid4().hex[:12]}"
    queue.create_topic(topic, PARTITIONS)
    sent = produce_numbered(queue, topic, 20)
    consumer = queue.consumer(topic, "g", member_id="m")
    got = drain(consumer, 20)
    consumer.commit(dict.fromkeys(range(PARTITIONS), 3))
    queue.close()

    reopened = open_queue()
    assert reopened.end_offsets(topic) == dict.fromkeys(range(PARTITIONS), 5)
    assert reopened.committed(topic, "g") == dict.fromkeys(range(PARTITIONS), 3)
    rest = drain(reopened.consumer(topic, "g", member_id="m"), 8)
    assert sorted(values(rest)) == sorted(r.value for r in got if r.offset >= 3)
    assert set(values(got)) == set(sent)


def test_create_topic_is_idempotent(queue: Queue, topic: str) -> None:
    produce_numbered(queue, topic, 5)
    queue.create_topic(topic, PARTITIONS)
    assert sum(queue.end_offsets(topic).values()) == 5
    with pytest.raises(ValueError, match="partitions"):
        queue.create_topic(topic, PARTITIONS + 1)


def test_commit_of_a_lost_partition_fails_and_the_new_owner_gets_the_records(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 20)
    first = queue.consumer(topic, "g", member_id="a")
    got = drain(first, 20)
    second = queue.consumer(topic, "g", member_id="b")  # joining takes half of first's partitions

    with pytest.raises(CommitFailedError, match="no longer owns"):
        first.commit(next_offsets(got))
    assert queue.committed(topic, "g") == dict.fromkeys(range(PARTITIONS), 0)  # all or nothing

    first.poll(1, timeout_s=0)  # follows the rebalance
    kept = first.assignment()
    assert kept and kept != set(range(PARTITIONS))
    first.commit({p: o for p, o in next_offsets(got).items() if p in kept})
    redelivered = drain(second, 20 - sum(1 for r in got if r.partition in kept))
    assert {r.partition for r in redelivered} == second.assignment() == set(range(PARTITIONS)) - kept
    assert sorted(values(redelivered)) == sorted(r.value for r in got if r.partition not in kept)
    assert set(values(got)) == set(sent)


def test_a_partition_that_moved_away_and_back_still_fences_the_old_reads(queue: Queue, topic: str) -> None:
    produce_numbered(queue, topic, 20)
    a = queue.consumer(topic, "g", member_id="a")
    read_by_a = drain(a, 20)
    b = queue.consumer(topic, "g", member_id="b")
    moved = b.assignment()
    read_by_b = drain(b, sum(1 for r in read_by_a if r.partition in moved))
    b.commit(next_offsets(read_by_b))
    b.close()  # the partitions go back to a, which has not polled since it lost them

    with pytest.raises(CommitFailedError):
        a.commit(next_offsets(read_by_a))  # would rewind b's commits: a's reads predate b's
    assert queue.committed(topic, "g") == {p: 5 if p in moved else 0 for p in range(PARTITIONS)}
    # Back in a's hands (at once, or once a learns of the rebalance: Kafka tells it at its next
    # heartbeat), the moved partitions resume from b's commit: nothing of them comes again.
    deadline = time.monotonic() + 30
    while a.assignment() != set(range(PARTITIONS)):
        assert time.monotonic() < deadline, f"a never got the partitions back: {a.assignment()}"
        assert a.poll(100, timeout_s=0.2) == []
    assert a.poll(100, timeout_s=0.2) == []


def test_a_restarted_member_takes_over_its_id_and_fences_the_old_consumer(queue: Queue, topic: str) -> None:
    sent = produce_numbered(queue, topic, 8)
    old = queue.consumer(topic, "g", member_id="worker-0")
    got = drain(old, 8)
    new = queue.consumer(topic, "g", member_id="worker-0")

    with pytest.raises(MemberFencedError):
        old.commit(next_offsets(got))
    with pytest.raises(MemberFencedError):
        old.poll(1, timeout_s=0)
    assert sorted(values(drain(new, 8))) == sorted(sent)
    old.close()  # must not evict the new holder of the id
    new.commit(next_offsets(got))
    assert queue.backlog(topic, "g") == 0


def test_unknown_and_deleted_topics_are_errors(queue: Queue, topic: str) -> None:
    produce_numbered(queue, topic, 4)
    queue.delete_topic(topic)
    with pytest.raises(UnknownTopicError, match="create_topic"):
        queue.produce(topic, [b"x"])
    with pytest.raises(UnknownTopicError):
        queue.end_offsets(topic)
    with pytest.raises(UnknownTopicError):
        queue.consumer(topic, "g", member_id="m")
    queue.delete_topic(topic)  # deleting again is a no-op

    queue.create_topic(topic, 2)
    assert queue.end_offsets(topic) == {0: 0, 1: 0}
    assert queue.backlog(topic, "g") == 0


def test_produce_rejects_mismatched_keys(queue: Queue, topic: str) -> None:
    with pytest.raises(ValueError, match="one key per value"):
        queue.produce(topic, [b"a", b"b"], keys=[b"k"])
    assert queue.backlog(topic, "g") == 0


def test_next_offsets_is_the_highest_offset_plus_one_per_partition() -> None:
    records = [Record("t", p, o, None, b"", 0.0) for p, o in [(0, 3), (1, 0), (0, 5), (0, 4)]]
    assert next_offsets(records) == {0: 6, 1: 1}
    assert next_offsets([]) == {}
