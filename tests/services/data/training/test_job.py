"""The training job against the embedded queue and object store, on the tiny model."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

from contracts.job_result import JobResult
from contracts.samples import Sample, encode_group
from services.data.policy_store import fetch_policy, load_version
from services.data.training.job import run_training_job
from services.domain.names import (
    TRAINER_GROUP,
    policy_prefix,
    result_key,
    samples_topic,
    trainer_prefix,
    update_checkpoint_prefix,
)
from services.domain.runspec import RunSpec
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.queue.sqlite_queue import SqliteQueue
from trainer_core.models.loading import load_policy
from trainer_core.models.lora import is_lora

RUN = "run-job"


def spec(**changes) -> RunSpec:
    base = {"model": "tiny", "prompts": [{"prompt": "x"}], "samples_per_prompt": 4, "batch_samples": 8, "iterations": 9}
    return RunSpec.model_validate(base | changes)


def produce_groups(queue: SqliteQueue, groups: int, version: int) -> list[str]:
    ids = []
    for g in range(groups):
        group = uuid.uuid4().hex
        samples = [
            Sample(
                sample_id=uuid.uuid4().hex,
                run_id=RUN,
                prompt_id=str(g),
                group_id=group,
                prompt_ids=[5, 6, 7],
                response_ids=[8, 9, 10 + k],
                logprobs=[-4.0, -4.0, -4.0],
                reward=float(k % 2),
                reward_source="rule",
                policy_version=version,
                worker_id="w",
                generation_seconds=0.0,
                created_at=0.0,
            )
            for k in range(4)
        ]
        queue.produce(samples_topic(RUN), [encode_group(samples)], keys=[group.encode()])
        ids += [s.sample_id for s in samples]
    return ids


@pytest.fixture
def world(tmp_path: Path):
    queue = SqliteQueue(tmp_path / "queue.db")
    queue.create_topic(samples_topic(RUN), 2)
    yield queue, LocalObjectStore(tmp_path / "objects"), tmp_path / "models"
    queue.close()


def test_trains_one_batch_publishes_then_commits(world) -> None:
    queue, objects, models = world
    first = produce_groups(queue, 2, version=0)
    later = produce_groups(queue, 1, version=0)
    result = run_training_job(run_id=RUN, iteration=1, spec=spec(), queue=queue, objects=objects, model_cache=models)
    assert sorted(result.trained_ids) == sorted(first), "exactly one batch, the oldest groups"
    assert objects.exists(policy_prefix(RUN, 1) + "config.json")
    assert JobResult.from_json(objects.get_bytes(result_key(RUN, 1))) == result
    assert queue.backlog(samples_topic(RUN), TRAINER_GROUP) == len(later) // 4  # one record per group of 4
    # The workers' log-probs (-4.0) are above the policy's (-4.59 to -4.81 on the tiny model): every
    # ratio is below 0.8, so the clip binds exactly on the tokens of negative advantage, half of them.
    assert result.metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert result.metrics["perf/peak_memory_bytes"] >= result.metrics["perf/memory_bytes"] > 0


def test_stale_samples_are_dropped_and_counted(world) -> None:
    queue, objects, models = world
    produce_groups(queue, 2, version=0)
    run_training_job(run_id=RUN, iteration=1, spec=spec(), queue=queue, objects=objects, model_cache=models)
    produce_groups(queue, 2, version=1)
    run_training_job(run_id=RUN, iteration=2, spec=spec(), queue=queue, objects=objects, model_cache=models)
    stale = produce_groups(queue, 1, version=0)  # two versions behind v2, bound 1
    kept = produce_groups(queue, 1, version=1)  # one version behind: trained, with the correction
    decoupled = spec(training={"off_policy": "decoupled", "is_cap": 2.0})
    result = run_training_job(run_id=RUN, iteration=3, spec=decoupled, queue=queue, objects=objects, model_cache=models)
    assert result.dropped.stale == stale
    assert result.trained_ids == kept
    # The workers' log-probs (-4.0) are not the proximal policy's (about -4.6 on the tiny model):
    # each token is re-weighted by pi_proximal / pi_behaviour, about e^-0.6.
    assert 0.3 < result.metrics["actor/is_weight_mean"] < 0.9


def test_lora_runs_publish_adapters_and_continue_training_them(world) -> None:
    queue, objects, models = world
    lora = spec(training={"lora_rank": 4, "kl_coef": 0.1, "learning_rate": 1e-2})
    for iteration in (1, 2):
        produce_groups(queue, 2, version=iteration - 1)
        result = run_training_job(
            run_id=RUN, iteration=iteration, spec=lora, queue=queue, objects=objects, model_cache=models
        )
    assert result.metrics["actor/kl_ref"] > 0, "v1's adapter moved the policy away from the base"
    published = objects.list(policy_prefix(RUN, 2))
    assert any(k.endswith("adapter_config.json") for k in published)
    assert not any(k.endswith("/model.safetensors") for k in published), "only the adapter is published"
    trainable = fetch_policy(objects, RUN, 2, base_model="tiny", model_cache=models)
    assert is_lora(trainable.model) and any(p.requires_grad for p in trainable.model.parameters())

    # A rollout worker loads each version into the one base model it holds: v1's adapter is
    # injected, v2's replaces its weights; the base weights stay where they are.
    served = load_policy("tiny", cache_dir=models).model
    base_storage = {n: p.data_ptr() for n, p in served.named_parameters()}
    for version in (1, 2):
        served = load_version(served, objects, RUN, version, models)
    assert is_lora(served) and not any(p.requires_grad for p in served.parameters())
    assert {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p.data_ptr()
        for n, p in served.named_parameters()
        if "lora_" not in n
    } == base_storage
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, trainable.model(ids).logits, atol=1e-5, rtol=1e-4)


def test_a_worker_loads_full_weight_versions_into_its_model_in_place(world) -> None:
    queue, objects, models = world
    for iteration in (1, 2):
        produce_groups(queue, 2, version=iteration - 1)
        run_training_job(
            run_id=RUN,
            iteration=iteration,
            spec=spec(training={"learning_rate": 1e-2}),
            queue=queue,
            objects=objects,
            model_cache=models,
        )
    served = load_policy("tiny", cache_dir=models).model
    storage = [p.data_ptr() for p in served.parameters()]
    for version in (1, 2):
        assert load_version(served, objects, RUN, version, models) is served
    assert [p.data_ptr() for p in served.parameters()] == storage
    want = fetch_policy(objects, RUN, 2, base_model="tiny", model_cache=models).model.state_dict()
    initial = load_policy("tiny", cache_dir=models).model.state_dict()
    for name, value in served.state_dict().items():
        assert not torch.equal(want[name], initial[name]) or "norm" in name, f"{name} was not trained"
        assert torch.equal(value, want[name]), name


def test_a_job_finding_its_version_published_only_commits(world) -> None:
    """A crash between publishing v1 and committing: the retried job must not train again."""
    queue, objects, models = world
    ids = produce_groups(queue, 2, version=0)
    end = queue.end_offsets(samples_topic(RUN))
    published = JobResult(
        iteration=1,
        policy_version=1,
        mean_reward=0.5,
        metrics={"marker": 1.0},
        samples_read=len(ids),
        trained_ids=ids,
        offsets=end,
        seconds=1.0,
        ended_at=1.0,
    )
    objects.put_bytes(result_key(RUN, 1), published.to_json())
    result = run_training_job(run_id=RUN, iteration=1, spec=spec(), queue=queue, objects=objects, model_cache=models)
    assert result == published
    assert queue.backlog(samples_topic(RUN), TRAINER_GROUP) == 0
    assert not objects.exists(policy_prefix(RUN, 1) + "config.json"), "nothing was trained"


def test_micro_batch_zero_sizes_micro_batches_from_free_memory(world) -> None:
    queue, objects, models = world
    trained = produce_groups(queue, 2, version=0)
    auto = spec(training={"micro_batch": 0})
    result = run_training_job(run_id=RUN, iteration=1, spec=auto, queue=queue, objects=objects, model_cache=models)
    assert sorted(result.trained_ids) == sorted(trained)
    assert result.metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_carries_its_critic_and_optimizer_across_iterations(world, critic: str) -> None:
    import io

    from services.domain.names import trainer_prefix

    queue, objects, models = world
    ppo = spec(algorithm="ppo", training={"learning_rate": 1e-3, "critic": critic})
    vf_losses = []
    for iteration in (1, 2):
        produce_groups(queue, 2, version=iteration - 1)
        result = run_training_job(
            run_id=RUN, iteration=iteration, spec=ppo, queue=queue, objects=objects, model_cache=models
        )
        vf_losses.append(result.metrics["critic/vf_loss"])
    # v1: the head starts at zero, so every value is 0 and a 3-token response of reward R has the
    # GAE returns (0.95^2 R, 0.95 R, R) (gamma 1, lam 0.95). Rewards 0, 1, 0, 1 over 4 x 3 tokens:
    # 0.5 * mean squared error = 0.5 * (0.95^4 + 0.95^2 + 1) / 6 = 0.2264.
    assert vf_losses[0] == pytest.approx(0.5 * (0.95**4 + 0.95**2 + 1) / 6, rel=1e-5)
    # v2 starts from v1's trained critic, nearer the same returns (a fresh one would give 0.2264 again).
    assert vf_losses[1] < 0.99 * vf_losses[0]
    head = torch.load(io.BytesIO(objects.get_bytes(trainer_prefix(RUN, 2) + "value_head.pt")), weights_only=True)
    assert any(t.abs().sum() > 0 for t in head.values()), "the critic learned (it starts at zero)"
    # A separate critic carries its own backbone; a shared one is just the linear head.
    assert any(k.startswith("backbone.") for k in head) == (critic == "separate")
    assert objects.exists(trainer_prefix(RUN, 2) + "optimizer/optimizer.pt")
    assert not objects.list(trainer_prefix(RUN, 1) + "optimizer"), "only the latest optimizer state is kept"


def test_an_adaptive_kl_coefficient_carries_across_iterations(world) -> None:
    queue, objects, models = world
    adaptive = spec(
        training={"lora_rank": 4, "kl_coef": 0.1, "kl_target": 1e-9, "kl_horizon": 8, "learning_rate": 1e-2}
    )
    coefs = []
    for iteration in (1, 2):
        produce_groups(queue, 2, version=iteration - 1)
        result = run_training_job(
            run_id=RUN, iteration=iteration, spec=adaptive, queue=queue, objects=objects, model_cache=models
        )
        coefs.append(result.metrics["actor/kl_coef"])
    # v1 starts at the reference (KL 0 < target: x0.8 over a horizon of 8 samples); v2 starts from
    # v1's coefficient and, with the policy moved, KL > target: x1.2.
    assert coefs[0] == pytest.approx(0.1 * 0.8)
    assert coefs[1] == pytest.approx(coefs[0] * 1.2)
    with pytest.raises(ValueError, match="kl_coef > 0"):
        spec(training={"kl_target": 0.1})


def test_the_next_iteration_continues_the_stored_optimizer_state(world) -> None:
    """Iteration 2 steps on from iteration 1's AdamW state (step 2), stored under the trainer
    prefix's optimizer/, or at the trainer prefix's optimizer.pt where one-process jobs of
    earlier releases stored it."""
    import io

    from services.domain.names import trainer_prefix

    queue, objects, models = world
    for iteration in (1, 2):
        produce_groups(queue, 2, version=iteration - 1)
        if iteration == 2:  # as an earlier release left it
            stored = trainer_prefix(RUN, 1) + "optimizer/optimizer.pt"
            objects.put_bytes(trainer_prefix(RUN, 1) + "optimizer.pt", objects.get_bytes(stored))
            objects.delete_prefix(trainer_prefix(RUN, 1) + "optimizer/")
        run_training_job(run_id=RUN, iteration=iteration, spec=spec(), queue=queue, objects=objects, model_cache=models)
        state = torch.load(
            io.BytesIO(objects.get_bytes(trainer_prefix(RUN, iteration) + "optimizer/optimizer.pt")), weights_only=True
        )
        assert {int(s["step"]) for s in state["state"].values()} == {iteration}
    assert not objects.list(trainer_prefix(RUN, 1) + "optimizer")


class CountedListings:
    """An object store that counts how often each prefix is listed."""

    def __init__(self, objects: LocalObjectStore) -> None:
        self._objects = objects
        self.listed: Counter[str] = Counter()

    def __getattr__(self, name: str):
        return getattr(self._objects, name)

    def list(self, prefix: str) -> list[str]:
        self.listed[prefix] += 1
        return self._objects.list(prefix)


def test_a_job_deletes_old_trainer_state_after_one_listing_of_the_trainer_folder(world) -> None:
    """Older optimizer states and the update checkpoints of published iterations are found in one
    listing of the run's trainer folder (on S3 a paginated one, of every stored shard)."""
    queue, objects, models = world
    produce_groups(queue, 2, version=0)
    run_training_job(run_id=RUN, iteration=1, spec=spec(), queue=queue, objects=objects, model_cache=models)
    objects.put_bytes(trainer_prefix(RUN, 0) + "optimizer.pt", b"left by an earlier release")
    for version in (1, 2, 3):  # of an earlier iteration, of this one, and of one not yet published
        objects.put_bytes(update_checkpoint_prefix(RUN, version) + "batch.json", b"{}")
    produce_groups(queue, 2, version=1)
    counted = CountedListings(objects)
    run_training_job(run_id=RUN, iteration=2, spec=spec(), queue=queue, objects=counted, model_cache=models)
    assert counted.listed[f"runs/{RUN}/trainer/"] == 1
    assert [v for v in (0, 1, 2) if objects.list(trainer_prefix(RUN, v) + "optimizer")] == [2]
    assert [v for v in (1, 2, 3) if objects.list(update_checkpoint_prefix(RUN, v))] == [3]


def test_the_job_trains_with_the_specs_training_section(world, monkeypatch: pytest.MonkeyPatch) -> None:
    """The section a client sent is the config the update runs with: no field is copied by hand,
    so none is dropped on the way (tests/services/control/api/test_training_section.py carries each field
    from the API to the stored spec)."""
    from services.data.training import job

    queue, objects, models = world
    produce_groups(queue, 2, version=0)
    training = {
        "learning_rate": 3e-5,
        "epochs": 2,
        "mini_batch": 4,
        "micro_batch": 2,
        "clip_ratio": 0.3,
        "clip_ratio_high": 0.28,
        "dual_clip": 3.0,
        "loss_agg": "seq-mean-token-sum",
        "adv_estimator": "rloo",
        "entropy_coef": 0.01,
        "max_grad_norm": 0.5,
        "kl_coef": 0.05,
        "kl_estimator": "k2",
        "kl_mode": "reward",
        "kl_target": 0.1,
        "kl_horizon": 500,
        "off_policy": "decoupled",
        "is_cap": 3.0,
        "lora_rank": 4,
        "lora_alpha": 16.0,
        "gradient_checkpointing": True,
        "logprob_chunk_tokens": 2,
        "share_prompt_prefix": False,
        "pack_max_tokens": 16,
    }
    run_spec = spec(sampling={"temperature": 0.7}, training=training)
    seen = []

    def recording(model, samples, cfg, *args, **kwargs):
        seen.append(cfg)
        return train_on_batch(model, samples, cfg, *args, **kwargs)

    train_on_batch = job.train_on_batch
    monkeypatch.setattr(job, "train_on_batch", recording)
    run_training_job(run_id=RUN, iteration=1, spec=run_spec, queue=queue, objects=objects, model_cache=models)
    assert seen == [run_spec.training]
    assert {k: v for k, v in seen[0].model_dump(mode="json").items() if k in training} == training
    assert (seen[0].algorithm, seen[0].temperature) == ("grpo", 0.7)
