"""Shared fixtures: a per-session model cache, the builtin "tiny" policy and SmolLM2 converted once."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from contracts.samples import Sample
from trainer_core.models.loading import Policy, load_policy


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def tiny_policy(model_cache: Path) -> Policy:
    """A fresh copy per test (tests train it); the weights come from the session cache."""
    return load_policy("tiny", cache_dir=model_cache)


@pytest.fixture(scope="session")
def smollm2_converted(model_cache: Path) -> Policy:
    """SmolLM2-135M as `load_policy` returns it right after converting its GGUF (~25 s), done once
    per session into the session cache and shared: read-only (a test that trains takes a copy)."""
    assert not (model_cache / "smollm2-135m").exists(), "this fixture must be the one that converts it"
    return load_policy("smollm2-135m", cache_dir=model_cache)


@pytest.fixture
def make_sample() -> Callable[..., Sample]:
    def make(
        prompt_ids: list[int],
        response_ids: list[int],
        logprobs: list[float],
        reward: float,
        group_id: str = "g0",
    ) -> Sample:
        return Sample(
            sample_id=uuid.uuid4().hex,
            run_id="run-1",
            prompt_id=f"prompt-{group_id}",
            group_id=group_id,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            reward=reward,
            reward_source="test",
            policy_version=0,
            worker_id="worker-0",
            generation_seconds=0.1,
            created_at=1_700_000_000.5,
        )

    return make
