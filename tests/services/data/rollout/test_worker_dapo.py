"""The rollout side of DAPO's dynamic sampling and of ReMax's greedy baseline."""

from __future__ import annotations

import threading

from contracts.messages import PromptMessage
from contracts.samples import Sample
from services.core.config import Settings
from services.data.rollout.dynamic_sampling import informative_groups
from services.domain.names import prompts_topic, samples_topic
from services.ports.wiring import open_backends
from tests.services.data.rollout.test_worker_rewards import RUN, make_worker, spec_with


def _sample(group_id: str, reward: float) -> Sample:
    return Sample(
        sample_id=f"{group_id}-{reward}",
        run_id=RUN,
        prompt_id=group_id,
        group_id=group_id,
        prompt_ids=[1],
        response_ids=[2],
        logprobs=[0.0],
        reward=reward,
        reward_source="test",
        policy_version=0,
        worker_id="w0",
        generation_seconds=0.1,
        created_at=0.0,
    )


def test_informative_groups_drop_all_equal_groups_and_count_their_samples() -> None:
    samples = [
        _sample(g, r)
        for g, r in [("a", 1.0), ("a", 0.0), ("b", 0.5), ("b", 0.5), ("b", 0.5), ("c", 1.0), ("d", 0.0), ("d", 1.0)]
    ]
    kept, dropped = informative_groups(samples)
    assert [[s.group_id for s in g] for g in kept] == [["a", "a"], ["d", "d"]]
    assert dropped == 4  # b's three (all 0.5) and the singleton c


def test_a_remax_worker_scores_a_greedy_response_per_prompt_and_drops_uninformative_groups(
    settings: Settings, wait_for
) -> None:
    b = open_backends(settings)
    spec = spec_with(
        [{"fn": "regex", "pattern": "(?!)"}],  # never matches: every reward 0, every group all-equal
        sampling={"max_new_tokens": 4},
        training={"adv_estimator": "remax", "dynamic_sampling": True},
    )
    b.queue.create_topic(prompts_topic(RUN), 1)
    b.queue.create_topic(samples_topic(RUN), 1)
    b.queue.produce(prompts_topic(RUN), [PromptMessage(f"p{i}", "x", None).encode() for i in range(2)])
    worker = make_worker(b, settings, spec)
    worker._load_latest_policy()
    probe = b.queue.consumer(prompts_topic(RUN), "probe", member_id="probe", session_timeout_s=60.0)
    samples = worker._generate(probe.poll(2, timeout_s=5.0))
    probe.close()
    assert len(samples) == 4 and {s.baseline_reward for s in samples} == {0.0}  # the greedy response's reward

    thread = threading.Thread(target=worker.run, daemon=True)  # the rollout group's own pass
    thread.start()
    try:
        wait_for(
            lambda: b.state.get_run(RUN).samples_filtered >= 4,
            timeout_s=60,
            message="the worker dropped the 2 all-equal groups",
        )
    finally:
        worker.stop.set()
        thread.join(timeout=60)
    run = b.state.get_run(RUN)
    assert (run.samples_filtered, run.samples_dropped) == (
        4,
        0,
    )  # dropped before queueing: not the queued samples' drops
    assert sum(b.queue.end_offsets(samples_topic(RUN)).values()) == 0  # nothing queued
    b.close()
