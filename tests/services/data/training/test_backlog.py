from __future__ import annotations

from pathlib import Path

from services.domain.backlog import SampleBacklog, read_backlog, sample_backlog, take_batch, trainer_consumer
from services.domain.names import samples_topic
from services.ports.queue.queue import Record
from services.ports.queue.sqlite_queue import SqliteQueue


def test_take_batch_takes_the_oldest_groups_as_partition_prefixes() -> None:
    # One group per record: two in partition 0, one in partition 1, produced in this order.
    records = [
        Record("t", 0, 0, b"g1", b"", 1.0),
        Record("t", 1, 0, b"g2", b"", 2.0),
        Record("t", 0, 1, b"g3", b"", 3.0),
    ]
    taken, offsets = take_batch(records[::-1], groups=2)
    assert [(r.partition, r.offset) for r in taken] == [(0, 0), (1, 0)]
    assert offsets == {0: 1, 1: 1}


def test_take_batch_keeps_partition_prefixes_when_producers_clocks_disagree() -> None:
    # Partition 0's second record was stamped by a producer whose clock runs behind: taking it
    # before the first would commit past a record never trained.
    records = [
        Record("t", 0, 0, b"g1", b"", 5.0),
        Record("t", 0, 1, b"g2", b"", 1.0),
        Record("t", 1, 0, b"g3", b"", 2.0),
    ]
    taken, offsets = take_batch(records, groups=2)
    assert [(r.partition, r.offset) for r in taken] == [(1, 0), (0, 0)]
    assert offsets == {0: 1, 1: 1}


def test_the_sample_backlog_counts_samples_and_the_trainer_commits_records(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "queue.db")
    queue.create_topic(samples_topic("r"), 2)
    queue.produce(samples_topic("r"), [b"g1", b"g2", b"g3"])  # three groups of 4 samples
    assert sample_backlog(queue, "r", group_size=4) == SampleBacklog(queued=12, produced=12, committed=0)

    consumer = trainer_consumer(queue, "r")
    _, offsets = take_batch(read_backlog(queue, consumer, "r")[0], groups=2)
    consumer.commit(offsets)
    assert sample_backlog(queue, "r", group_size=4) == SampleBacklog(queued=4, produced=12, committed=2)
    queue.close()
