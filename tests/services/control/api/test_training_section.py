"""The run spec's `training` section is the trainer's config, declared once (contracts.training):
every field a client sets travels API -> state store -> the spec a pod reads, unchanged.

`NON_DEFAULT` gives every field a value other than its default; a field added to TrainConfig
without an entry here fails `test_every_field_has_a_non_default_value`, so none is left out.
(That the training job hands this very config to the update is tests/services/data/training/test_job.py's
`test_the_job_trains_with_the_specs_training_section`.)
"""

from __future__ import annotations

import httpx

from contracts.training import TrainConfig
from services.domain.runspec import RunSpec

# Set by the run, not in the section: `algorithm`, `sampling.temperature` and `sampling.max_new_tokens`.
DERIVED = {"algorithm", "temperature", "max_new_tokens"}
NON_DEFAULT = {
    "learning_rate": 3e-5,
    "epochs": 2,
    "mini_batch": 8,
    "micro_batch": 4,
    "micro_batch_tokens": 512,
    "clip_ratio": 0.3,
    "clip_ratio_high": 0.28,
    "dual_clip": 3.0,
    "loss_agg": "seq-mean-token-mean",
    "adv_estimator": "gae",
    "gamma": 0.99,
    "lam": 0.9,
    "vf_coef": 0.25,
    "value_clip": 0.5,
    "entropy_coef": 0.01,
    "max_grad_norm": 0.5,
    "kl_coef": 0.05,
    "kl_estimator": "k2",
    "kl_mode": "reward",
    "kl_target": 0.1,
    "kl_horizon": 500,
    "off_policy": "decoupled",
    "is_cap": 3.0,
    "is_level": "sequence",
    "is_batch_normalize": True,
    "policy_loss": "gspo",
    "clip_cov_ratio": 0.001,
    "clip_cov_lb": 0.5,
    "clip_cov_ub": 4.0,
    "kl_cov_ratio": 0.001,
    "ppo_kl_coef": 0.5,
    "kl_clamp": 10.0,
    "overlong_buffer": 16,
    "overlong_penalty": 0.5,
    "dynamic_sampling": True,
    "shuffle": False,
    "seed": 7,
    "lora_rank": 4,
    "lora_alpha": 16.0,
    "critic": "separate",
    "autocast_bf16": True,
    "gradient_checkpointing": True,
    "logprob_chunk_tokens": 256,
    "share_prompt_prefix": False,
    "pack_max_tokens": 1024,
    "instance_type": "p5.48xlarge",
    "processes": 8,
    "nodes": 2,
    "strategy": "zero3",
    "offload_optimizer": True,
    "max_retries": 5,
    "capacity": "spot",
    "checkpoint_every_s": 120.0,
    "spot_zones": ["us-east-1a", "us-east-1b"],
}


def test_every_field_has_a_non_default_value_and_a_description() -> None:
    fields = TrainConfig.model_fields
    assert set(fields) - DERIVED == set(NON_DEFAULT), "give each new field a non-default value here"
    for name, value in NON_DEFAULT.items():
        assert fields[name].default != value, name
        assert fields[name].description, f"training.{name} needs a one-line description"


async def test_every_field_reaches_the_spec_a_pod_reads(api: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompts": [{"prompt": "What is 2 + 3?", "answer": "5"}],
        "algorithm": "ppo",
        "sampling": {"temperature": 0.7, "max_new_tokens": 48},
        "samples_per_prompt": 4,
        "batch_samples": 8,
        "iterations": 1,
        "training": NON_DEFAULT,
    }
    r = await api.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["training"] == NON_DEFAULT, "the API shows the section as given"

    # What a pod reads: the stored spec (the rollout worker's and the training job's `_pod`).
    stored = api.app.state.backends.state.get_run(r.json()["id"]).spec  # type: ignore[attr-defined]
    training = RunSpec.from_stored(stored).training
    assert training.model_dump(mode="json") == NON_DEFAULT
    assert (training.algorithm, training.temperature, training.max_new_tokens) == ("ppo", 0.7, 48), "the run's"


async def test_the_run_sets_algorithm_and_temperature_not_the_section(api: httpx.AsyncClient) -> None:
    for name, source in (
        ("algorithm", "algorithm"),
        ("temperature", "sampling.temperature"),
        ("max_new_tokens", "sampling.max_new_tokens"),
    ):
        r = await api.post(
            "/v1/runs",
            json={
                "model": "tiny",
                "prompts": [{"prompt": "a"}],
                "batch_samples": 8,
                "iterations": 1,
                "training": {name: "ppo" if name == "algorithm" else 0.5},
            },
        )
        assert r.status_code == 422
        assert any(f"`{source}`" in d["msg"] for d in r.json()["detail"]), r.json()


def test_the_openapi_section_has_enums_and_no_derived_fields(api: httpx.AsyncClient) -> None:
    schema = api.app.openapi()["components"]["schemas"]  # type: ignore[attr-defined]
    section = schema["TrainConfig"]["properties"]
    assert DERIVED.isdisjoint(section)
    assert set(section) == set(NON_DEFAULT)
    assert schema["LossAggMode"]["enum"] == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "token-sum",
        "seq-mean-token-sum-norm",
    ]
    assert "gspo" in schema["PolicyLoss"]["enum"] and section["policy_loss"]["$ref"].endswith("/PolicyLoss")
    assert section["loss_agg"]["$ref"].endswith("/LossAggMode")
