from __future__ import annotations

from services.backends.queue import Record
from services.training.backlog import take_batch


def test_take_batch_takes_oldest_whole_groups_as_partition_prefixes() -> None:
    # Two groups of 2 in partition 0, one in partition 1, produced in this order.
    records = [
        Record("t", 0, 0, b"g1", b"", 1.0), Record("t", 0, 1, b"g1", b"", 1.0),
        Record("t", 1, 0, b"g2", b"", 2.0), Record("t", 1, 1, b"g2", b"", 2.0),
        Record("t", 0, 2, b"g3", b"", 3.0), Record("t", 0, 3, b"g3", b"", 3.0),
    ]
    taken, offsets = take_batch(records[::-1], batch_samples=3, group_size=2)
    assert [(r.partition, r.offset) for r in taken] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert offsets == {0: 2, 1: 2}
