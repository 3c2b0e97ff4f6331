from __future__ import annotations

from services.training.job import select_samples
from trainer_core.samples import Sample


def sample(sid: str, version: int) -> Sample:
    return Sample(sample_id=sid, run_id="r", prompt_id="0", group_id="g", prompt_ids=[1], response_ids=[2],
                  logprobs=[-0.1], reward=1.0, reward_source="rule", policy_version=version, worker_id="w",
                  generation_seconds=0.1, created_at=0.0)


def test_drops_duplicates_and_stale_samples() -> None:
    batch = [sample("a", 3), sample("b", 2), sample("a", 3), sample("c", 1), sample("d", 3)]
    sel = select_samples(batch, seen={"d"}, policy_version=3, staleness_bound=1)
    assert [s.sample_id for s in sel.kept] == ["a", "b"]
    assert sel.dropped == {"duplicate": ["a", "d"], "stale": ["c"]}


def test_bound_zero_keeps_only_on_policy() -> None:
    sel = select_samples([sample("a", 2), sample("b", 1)], seen=set(), policy_version=2, staleness_bound=0)
    assert [s.sample_id for s in sel.kept] == ["a"]


def test_take_batch_takes_oldest_whole_groups_as_partition_prefixes() -> None:
    from services.backends.queue import Record
    from services.training.job import take_batch

    # Two groups of 2 in partition 0, one in partition 1, produced in this order.
    records = [
        Record("t", 0, 0, b"g1", b"", 1.0), Record("t", 0, 1, b"g1", b"", 1.0),
        Record("t", 1, 0, b"g2", b"", 2.0), Record("t", 1, 1, b"g2", b"", 2.0),
        Record("t", 0, 2, b"g3", b"", 3.0), Record("t", 0, 3, b"g3", b"", 3.0),
    ]
    taken, offsets = take_batch(records[::-1], batch_samples=3, group_size=2)
    assert [(r.partition, r.offset) for r in taken] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert offsets == {0: 2, 1: 2}
