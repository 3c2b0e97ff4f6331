from __future__ import annotations

from services.backends.queue import Record
from services.training.backlog import take_batch


def test_take_batch_takes_the_oldest_groups_as_partition_prefixes() -> None:
    # One group per record: two in partition 0, one in partition 1, produced in this order.
    records = [Record("t", 0, 0, b"g1", b"", 1.0), Record("t", 1, 0, b"g2", b"", 2.0), Record("t", 0, 1, b"g3", b"", 3.0)]
    taken, offsets = take_batch(records[::-1], groups=2)
    assert [(r.partition, r.offset) for r in taken] == [(0, 0), (1, 0)]
    assert offsets == {0: 1, 1: 1}


def test_take_batch_keeps_partition_prefixes_when_producers_clocks_disagree() -> None:
    # Partition 0's second record was stamped by a producer whose clock runs behind: taking it
    # before the first would commit past a record never trained.
    records = [Record("t", 0, 0, b"g1", b"", 5.0), Record("t", 0, 1, b"g2", b"", 1.0), Record("t", 1, 0, b"g3", b"", 2.0)]
    taken, offsets = take_batch(records, groups=2)
    assert [(r.partition, r.offset) for r in taken] == [(1, 0), (0, 0)]
    assert offsets == {0: 1, 1: 1}
