"""Every hyper-parameter of the run spec's `training` section reaches the update.

The journey, one test each: the API stores the section as sent (tests/services/control/api/
test_training_section.py walks every field); the training job hands that very config to
`train_on_batch` (test_job.py); here, walking `TrainConfig`'s fields, the job and the update read
every one that is not the shape of a pod, and each PPO hyper-parameter changes what is trained.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import pytest
import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from services.data.training.job import run_training_job
from services.domain.names import samples_topic
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.queue.sqlite_queue import SqliteQueue
from tests.services.data.training.test_job import RUN, produce_groups, spec
from trainer_core.models.loading import load_policy
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.update import train_on_batch

# Read before any job process runs, or only by a data-parallel one (test_job_data_parallel.py).
READ_ELSEWHERE = {
    "instance_type": "the scheduler's pod spec",
    "max_retries": "the scheduler, when a training job fails",
    "strategy": "a job of more than one process",
    "offload_optimizer": "a ZeRO job of more than one process",
    "dynamic_sampling": "the rollout worker, which drops the groups whose rewards are all equal",
    "checkpoint_every_s": "a job on spot capacity (tests/services/data/training/test_job_resume.py)",
    "spot_zones": "the scheduler, placing a spot job's pod",
}


def _recording(config: TrainConfig, read: set[str]) -> TrainConfig:
    """`config`, noting in `read` each field the code reads from it (its checks at construction aside)."""

    class Recording(TrainConfig):
        def __getattribute__(self, name: str):
            if name in TrainConfig.model_fields:
                read.add(name)
            return super().__getattribute__(name)

    recording = Recording(**config.model_dump(), algorithm=config.algorithm, temperature=config.temperature)
    read.clear()
    return recording


@pytest.mark.parametrize("off_policy", ["behaviour", "decoupled"])
def test_the_job_reads_every_field_but_the_pods_shape(tmp_path: Path, off_policy: str) -> None:
    """One PPO job per off-policy mode (only the decoupled one weights stale tokens: is_cap and the IS
    weights' options), with the optional parts on: LoRA, KL to the reference with an adaptive
    coefficient, entropy, overlong shaping, and two shuffled mini-batches (of a group each)."""
    queue = SqliteQueue(tmp_path / "queue.db")
    queue.create_topic(samples_topic(RUN), 2)
    produce_groups(queue, 2, version=0)
    section = {
        "kl_coef": 0.05,
        "kl_target": 0.1,
        "entropy_coef": 0.01,
        "lora_rank": 4,
        "off_policy": off_policy,
        "overlong_buffer": 2,
        "mini_batch": 4,
    }
    run_spec = spec(algorithm="ppo", training=section)
    read: set[str] = set()
    run_spec = run_spec.model_copy(update={"training": _recording(run_spec.training, read)})
    run_training_job(
        run_id=RUN,
        iteration=1,
        spec=run_spec,
        queue=queue,
        objects=LocalObjectStore(tmp_path / "objects"),
        model_cache=tmp_path / "models",
    )
    queue.close()
    unweighted = {"is_cap", "is_level", "is_batch_normalize"} if off_policy == "behaviour" else set()
    assert set(TrainConfig.model_fields) - read == set(READ_ELSEWHERE) | unweighted


def _sample(i: int, gen: torch.Generator, vocab: int) -> Sample:
    n_prompt, n_response = (int(x) for x in torch.randint(2, 8, (2,), generator=gen))
    return Sample(
        sample_id=uuid.uuid4().hex,
        run_id=RUN,
        prompt_id=f"p{i % 2}",
        group_id=f"g{i % 2}",
        prompt_ids=torch.randint(3, vocab, (n_prompt,), generator=gen).tolist(),
        response_ids=torch.randint(3, vocab, (n_response,), generator=gen).tolist(),
        logprobs=(-4.6 + 0.3 * torch.randn(n_response, generator=gen)).tolist(),
        reward=float(torch.rand((), generator=gen)),
        reward_source="rule",
        policy_version=0,
        worker_id="w",
        generation_seconds=0.0,
        created_at=0.0,
    )


def test_each_ppo_hyper_parameter_changes_the_update(tmp_path: Path) -> None:
    """Two epochs of SGD on the tiny model and a value head: changing any one of these from the
    base moves the trained weights elsewhere (value_clip binds once the values have moved, in
    the second epoch)."""
    policy = load_policy("tiny", cache_dir=tmp_path / "models")
    gen = torch.Generator().manual_seed(0)
    samples = [_sample(i, gen, len(policy.tokenizer)) for i in range(6)]
    base = {"algorithm": "ppo", "epochs": 2, "max_grad_norm": 1e9}

    def trained(**change: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = copy.deepcopy(policy.model)
        value_head = ValueHead(model.config.hidden_size)
        trainable = list(model.parameters()) + list(value_head.parameters())
        train_on_batch(
            model, samples, TrainConfig(**base | change), torch.optim.SGD(trainable, lr=0.1), value_head=value_head
        )
        return [p.detach().clone() for p in trainable]

    reference = trained()
    assert all(torch.equal(a, b) for a, b in zip(trained(), reference, strict=True)), "the update is deterministic"
    changes = {"gamma": 0.5, "lam": 0.5, "vf_coef": 5.0, "value_clip": 1e-4, "max_grad_norm": 1e-3, "entropy_coef": 0.5}
    unchanged = [
        name
        for name, value in changes.items()
        if all(torch.equal(a, b) for a, b in zip(trained(**{name: value}), reference, strict=True))
    ]
    assert unchanged == []
