"""A rollout worker follows the run's policy versions in the one model it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contracts.samples import Sample, encode_group
from services.core.config import Settings
from services.data.policy_store import fetch_policy
from services.data.rollout.worker import RolloutWorker, StopSignal
from services.data.training.job import run_training_job
from services.domain.names import samples_topic
from services.domain.runspec import RunSpec
from services.ports.wiring import open_backends
from trainer_core.models.lora import is_lora

RUN = "run-worker"


def produce_batch(queue, iteration: int) -> None:
    for g in range(2):
        group = [
            Sample(
                sample_id=f"{iteration}-{g}-{k}",
                run_id=RUN,
                prompt_id=str(g),
                group_id=f"{iteration}-{g}",
                prompt_ids=[5, 6, 7 + g],
                response_ids=[8, 9, 10 + k],
                logprobs=[-4.0] * 3,
                reward=float(k % 2),
                reward_source="rule",
                policy_version=iteration - 1,
                worker_id="w",
                generation_seconds=0.0,
                created_at=float(iteration),
            )
            for k in range(4)
        ]
        queue.produce(samples_topic(RUN), [encode_group(group)], keys=[f"{iteration}-{g}".encode()])


@pytest.mark.parametrize("training", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_a_worker_serves_each_new_version_from_the_model_it_holds(tmp_path: Path, training: dict) -> None:
    spec = RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "x"}],
            "samples_per_prompt": 4,
            "batch_samples": 8,
            "iterations": 2,
            "sampling": {"max_new_tokens": 4},
            "training": {"learning_rate": 1e-2} | training,
        }
    )
    settings = Settings(home=tmp_path, model_cache=tmp_path / "models")
    b = open_backends(settings)
    b.state.create_run(RUN, name=None, spec=spec.model_dump(mode="json"))
    b.queue.create_topic(samples_topic(RUN), 2)
    worker = RolloutWorker(
        run_id=RUN,
        worker_id="w0",
        spec=spec,
        state=b.state,
        queue=b.queue,
        objects=b.objects,
        rewards=b.rewards,
        model_cache=settings.resolved_model_cache(),
        session_timeout_s=60.0,
        stop=StopSignal(1.0),
    )
    worker._load_latest_policy()
    model = worker._policy.model
    storage = {p.data_ptr() for p in model.parameters()}
    ids = torch.tensor([[5, 6, 7, 8]])

    for version in (1, 2):
        produce_batch(b.queue, version)
        run_training_job(
            run_id=RUN,
            iteration=version,
            spec=spec,
            queue=b.queue,
            objects=b.objects,
            model_cache=settings.resolved_model_cache(),
        )
        b.state.update_run(RUN, policy_version=version)
        worker._load_latest_policy()
        assert worker.version == version
        served = worker._policy.model
        assert is_lora(served) == bool(training)
        # The base weights are the ones the worker loaded at v0, wherever the version's live.
        assert storage <= {p.data_ptr() for p in served.parameters()}
        assert worker.engine._model is served
        want = fetch_policy(b.objects, RUN, version, base_model="tiny", model_cache=settings.resolved_model_cache())
        with torch.no_grad():
            torch.testing.assert_close(served(ids).logits, want.model(ids).logits, atol=1e-5, rtol=1e-4)
    completions = worker.engine.generate([[5, 6, 7]], worker.sampling, seed=0)
    assert completions is not None and len(completions[0].token_ids) >= 1
    b.close()
