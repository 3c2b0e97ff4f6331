"""A reward that fails or times out costs its response that term's score, never the worker."""

from __future__ import annotations

import logging
import threading

import pytest

from contracts.messages import PromptMessage
from contracts.samples import decode_group
from services.core.config import Settings
from services.data.reward.functions import RewardInput, reward_key
from services.data.rollout.worker import RolloutWorker, StopSignal
from services.domain.names import prompts_topic, samples_topic
from services.domain.reward_spec import RewardFn, RewardTerm
from services.domain.runspec import RunSpec
from services.ports.reward_cache.reward_cache import reward_cache_key
from services.ports.wiring import Backends, open_backends

RUN = "run-rewards"
# Exponential backtracking on any text of a few dozen characters; `(?!)` never matches.
NEVER_DECIDED = r"^(.|\s|\S)*(?!)"
# Exponential on a long word followed by a non-word character; quick on "yes".
BACKTRACKING = r"(\w+\s?)+$"


def make_worker(b: Backends, settings: Settings, spec: RunSpec) -> RolloutWorker:
    b.state.create_run(RUN, name=None, spec=spec.model_dump(mode="json"))
    return RolloutWorker(
        run_id=RUN,
        worker_id="w0",
        spec=spec,
        state=b.state,
        queue=b.queue,
        objects=b.objects,
        rewards=b.rewards,
        model_cache=settings.resolved_model_cache(),
        session_timeout_s=60.0,
        stop=StopSignal(5.0),
    )


def spec_with(reward: list[dict], **fields: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "x"}],
            "iterations": 1,
            "samples_per_prompt": 2,
            "batch_samples": 4,
            "reward": reward,
        }
        | fields
    )


def test_a_failed_reward_is_counted_on_the_run_logged_once_and_not_cached(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    b = open_backends(settings)
    spec = spec_with([{"fn": "regex", "pattern": BACKTRACKING}, {"fn": "length_penalty", "target_tokens": 4}])
    worker = make_worker(b, settings, spec)
    prompts = [PromptMessage("p0", "say yes", None)]
    texts = ["yes", "word" * 500 + "!"]  # samples_per_prompt = 2

    with caplog.at_level(logging.WARNING, logger="services.data.rollout.worker"):
        first, _ = worker._score(prompts, texts, [1, 8])
        second, _ = worker._score(prompts, texts, [1, 8])

    # "yes" matches (1.0); the other timed out (0.0 for the regex) and keeps its length penalty -(8-4)/4.
    assert first == second == [1.0, -1.0]
    row = b.state.get_run(RUN)
    assert row.reward_failures == 2  # scored again the second time: a failure is not cached
    assert b.state.reward_failures(RUN) == {"regex:timeout": 2}
    assert row.last_reward_error.startswith("regex: pattern ") and "did not decide" in row.last_reward_error
    keys = [
        reward_cache_key(worker._terms_key, reward_key(RewardInput.of(prompts[0], t, n)))
        for t, n in zip(texts, [1, 8], strict=True)
    ]
    assert set(b.rewards.get_many(keys)) == {keys[0]}
    warnings = [r for r in caplog.records if "a reward failed" in r.getMessage()]
    assert len(warnings) == 1, "one warning per distinct reason, not per batch"
    b.close()


def test_a_reward_model_that_has_gone_scores_0_and_is_reported(settings: Settings) -> None:
    b = open_backends(settings)
    spec = spec_with([{"fn": "regex", "pattern": "yes"}])
    # As a stored spec holds it: the directory was checked on submission, and has since been deleted.
    gone = RewardTerm.model_construct(
        fn=RewardFn.REWARD_MODEL, weight=1.0, pattern=None, target_tokens=None, path=str(settings.home / "rm-deleted")
    )
    spec.reward.append(gone)
    worker = make_worker(b, settings, spec)

    rewards, _ = worker._score([PromptMessage("p0", "x", None)], ["yes", "no"], [1, 1])

    assert rewards == [1.0, 0.0]  # the regex term still counts
    row = b.state.get_run(RUN)
    assert row.reward_failures == 2
    assert row.last_reward_error.startswith("reward_model: ")
    b.close()


def test_a_worker_whose_regex_reward_times_out_still_produces_samples(settings: Settings, wait_for) -> None:
    """The report: a backtracking pattern held the worker forever, 0 samples in 90 s."""
    b = open_backends(settings)
    spec = spec_with([{"fn": "regex", "pattern": NEVER_DECIDED}], sampling={"max_new_tokens": 64})
    b.queue.create_topic(prompts_topic(RUN), 1)
    b.queue.create_topic(samples_topic(RUN), 1)
    b.queue.produce(prompts_topic(RUN), [PromptMessage(f"p{i}", "x", None).encode() for i in range(2)])
    worker = make_worker(b, settings, spec)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as e:  # noqa: BLE001 - surfaced to the test below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: sum(b.queue.end_offsets(samples_topic(RUN)).values()) >= 1 or errors,  # a group
            timeout_s=120,
            message="the worker queued the 4 samples of its 2 prompts",
        )
    finally:
        worker.stop.set()
        thread.join(timeout=60)
    assert errors == []
    assert not thread.is_alive()

    audit = b.queue.consumer(samples_topic(RUN), "audit", member_id="audit")
    samples = [s for r in audit.poll(100, timeout_s=1.0) for s in decode_group(r.value)]
    assert len(samples) == 4
    assert {s.reward for s in samples} == {0.0}  # the pattern never matches; a timeout scores 0.0
    row = b.state.get_run(RUN)
    assert row.reward_failures > 0
    assert "did not decide a response" in row.last_reward_error
    (stats,) = b.state.worker_stats(RUN)
    assert 0 < stats.generation_batch <= 4  # sequences generated at once, reported with the batch
    b.close()


@pytest.mark.parametrize(
    ("reward", "prompt", "said"),
    [
        ({"fn": "function", "path": "{data}/broken.py:compute_score"}, "x", "does not import"),
        ({"fn": "exact_match"}, [{"role": "user", "content": "2+3?"}], "no chat template"),
    ],
)
def test_a_run_its_worker_cannot_serve_fails_at_once_with_the_reason(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, reward: dict, prompt: object, said: str
) -> None:
    """The pod entry point fails the run (a reward file that does not import; chat prompts for a
    model without a chat template), rather than the scheduler relaunching the worker forever."""
    import typer

    from services.cli import pods as cli_pods

    data = settings.allowed_data_dirs()[0]
    (data / "broken.py").write_text("import no_such_module_anywhere\nSECRET = 'SECRET-USER-TEXT'\n")
    reward = {k: v.format(data=data) for k, v in reward.items()}
    b = open_backends(settings)
    spec = spec_with([reward], prompts=[{"prompt": prompt}])
    b.state.create_run(RUN, name=None, spec=spec.model_dump(mode="json"))
    b.queue.create_topic(prompts_topic(RUN), 1)
    b.queue.create_topic(samples_topic(RUN), 1)
    b.queue.produce(prompts_topic(RUN), [spec.prompts[0].message("0").encode()])
    for name, value in settings.pod_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPOTRL_SESSION_TIMEOUT_S", "3")

    with pytest.raises(typer.Exit):
        cli_pods.worker(RUN, worker_id="w0")

    row = b.state.get_run(RUN)
    assert (row.status, row.ending_status) == ("ENDING", "FAILED")
    assert said in row.ending_reason and "SECRET-USER-TEXT" not in row.ending_reason
