"""The scheduler reads a run's stored prompt set as the API wrote it (``services.domain.prompts.to_jsonl``)
and queues each prompt whole."""

from __future__ import annotations

from contracts.messages import PromptMessage
from contracts.status import RunStatus
from services.control.scheduler.loop import Scheduler
from services.core.config import Settings
from services.domain.names import prompts_key, prompts_topic
from services.domain.runspec import RunSpec
from services.ports.wiring import Backends

# Line and paragraph separators and NEL: JSON leaves them unescaped, `str.splitlines` cuts at them.
PROMPTS = ["a\u2028b", "c\u2029d", "e\x85f", "g\x0ch=", "plain"]
SPEC = RunSpec.model_validate(
    {
        "model": "tiny",
        "prompts": [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)],
        "samples_per_prompt": 2,
        "batch_samples": 2 * len(PROMPTS),
        "iterations": 1,
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 1},
    }
)


def queued_prompts(b: Backends, run_id: str) -> list[PromptMessage]:
    consumer = b.queue.consumer(prompts_topic(run_id), "probe", member_id="probe", session_timeout_s=60.0)
    try:
        return [PromptMessage.decode(r.value) for r in consumer.poll(100, timeout_s=5.0)]
    finally:
        consumer.close()


def test_prompts_holding_unicode_line_separators_reach_the_queue_whole(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b = scripted_backends
    run_id = submit(b, SPEC)
    assert "\u2028".encode() in b.objects.get_bytes(prompts_key(run_id)), "stored raw, as the API stores it"
    scheduler = Scheduler(b, settings)
    scheduler.tick()  # started
    scheduler.tick()  # publishes the first batch's prompts
    run = b.state.get_run(run_id)
    assert (run.status, run.last_error, run.prompts_published) == (RunStatus.RUNNING, None, len(PROMPTS))
    got = sorted((m.prompt_id, m.prompt, m.answer) for m in queued_prompts(b, run_id))
    assert got == [(str(i), p, str(i)) for i, p in enumerate(PROMPTS)]


def test_a_stored_prompt_set_that_does_not_parse_fails_the_run_instead_of_retrying_forever(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    b = scripted_backends
    run_id = submit(b, SPEC)
    b.objects.put_bytes(prompts_key(run_id), b'{"prompt": "cut\n')
    scheduler = Scheduler(b, settings)
    for _ in range(3):
        scheduler.tick()
    run = b.state.get_run(run_id)
    assert run.status in (RunStatus.ENDING, RunStatus.FAILED)
    assert "stored prompt set line 1" in (run.ending_reason or "")
