"""Which sampler a rollout worker builds from its run spec."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.rollout.worker import rollout_engine
from services.runspec import RunSpec
from trainer_core.engines.hf import HFEngine
from trainer_core.models.loading import load_policy


def test_the_hf_engine_samples_from_the_policy_object_itself(tmp_path: Path) -> None:
    policy = load_policy("tiny", cache_dir=tmp_path)
    engine = rollout_engine("hf", policy)
    assert isinstance(engine, HFEngine) and engine._model is policy.model


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed (a GPU machine, spotrl[gpu]): this test is of the error on machines without it",
)
def test_a_vllm_worker_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    spec = RunSpec.model_validate({"model": "tiny", "prompts": [{"prompt": "x"}], "iterations": 1, "rollout": {"engine": "vllm"}})
    with pytest.raises(ImportError, match=r"pip install 'spotrl\[gpu\]'"):
        rollout_engine(spec.rollout.engine, load_policy(spec.model, cache_dir=tmp_path))
