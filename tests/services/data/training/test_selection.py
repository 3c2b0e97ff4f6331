from __future__ import annotations

import dataclasses

from contracts.job_result import DroppedSamples
from contracts.samples import Sample
from services.data.training.selection import reward_metrics, select_samples


def sample(sid: str, version: int) -> Sample:
    return Sample(
        sample_id=sid,
        run_id="r",
        prompt_id="0",
        group_id="g",
        prompt_ids=[1],
        response_ids=[2],
        logprobs=[-0.1],
        reward=1.0,
        reward_source="rule",
        policy_version=version,
        worker_id="w",
        generation_seconds=0.1,
        created_at=0.0,
    )


def test_drops_duplicates_and_stale_samples() -> None:
    batch = [sample("a", 3), sample("b", 2), sample("a", 3), sample("c", 1), sample("d", 3)]
    sel = select_samples(batch, seen={"d"}, policy_version=3, staleness_bound=1)
    assert [s.sample_id for s in sel.kept] == ["a", "b"]
    assert sel.dropped == DroppedSamples(duplicate=["a", "d"], stale=["c"])


def test_bound_zero_keeps_only_on_policy() -> None:
    sel = select_samples([sample("a", 2), sample("b", 1)], seen=set(), policy_version=2, staleness_bound=0)
    assert [s.sample_id for s in sel.kept] == ["a"]


def test_the_rewards_figures_are_averaged_over_the_samples_that_report_each() -> None:
    samples = [
        dataclasses.replace(sample("a", 1), reward_metrics={"acc": 1.0, "format": 1.0}),
        dataclasses.replace(sample("b", 1), reward_metrics={"acc": 0.0}),
        sample("c", 1),
    ]
    assert reward_metrics(samples) == {"reward/acc/mean": 0.5, "reward/format/mean": 1.0}
    assert reward_metrics([sample("d", 1)]) == {}
