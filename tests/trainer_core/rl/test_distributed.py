"""Data-parallel strategies against one process: 2 CPU ranks (torchrun, gloo) each train the tiny
policy on half of a fixed batch; the metrics and the updated weights must be those of one process
training on the whole batch.

The worker (`dist_worker.py`) builds the batch, configs and models for both sides. Its configs take
two AdamW steps of several accumulated micro-batches each, with a KL term, clipping and LM-head
chunks. AdamW's first steps are about lr * sign(g), insensitive to the gradient's scale, so the
comparison has three parts: `actor/grad_norm` (the norm of the averaged gradient before clipping)
checks the gradient's scale; the weights, within 2% of one step (lr), check its direction element
by element (a gradient perturbed by float noise delta moves an update by at most lr * delta / eps,
far below that); and the second step's losses check that the first update landed as it should.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_worker import SCENARIOS, WORLD_SIZE, build_models, make_batch, single_process_order, train_config

from contracts.samples import Sample
from tests.torchrun import REPO, output, run_ranks
from trainer_core.models.loading import load_policy
from trainer_core.rl.distributed import init_distributed, shard_samples
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch
from trainer_core.rl.zero import _import_deepspeed, deepspeed_config

WORKER = Path(__file__).with_name("dist_worker.py")
# strategy -> (scenarios, DeepSpeed config overrides). ZeRO-3 keeps parameters smaller than
# stage3_param_persistence_threshold whole; at 0 every parameter of the tiny model is partitioned
# and gathered per module call, as a real model's would be.
LAUNCHES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "fsdp2": (["grpo", "ppo", "grpo-tied", "grpo-checkpointed", "grpo-lora", "grpo-shared-prompts"], {}),
    "zero2-offload": (["grpo", "ppo", "grpo-lora"], {}),
    "zero3-offload": (
        ["grpo", "ppo", "grpo-tied", "grpo-checkpointed", "grpo-shared-prompts", "grpo-lora"],
        {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    ),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Callable[[str], dict[str, Any]]:
    """Rank 0's results of one 2-process launch per strategy, launched on first use."""
    load_policy("tiny", cache_dir=model_cache)  # built once here, not by both ranks at once
    results: dict[str, dict[str, Any]] = {}

    def get(strategy: str) -> dict[str, Any]:
        if strategy not in results:
            results[strategy] = _launch(strategy, model_cache, tmp_path_factory.mktemp(strategy))
        return results[strategy]

    return get


@pytest.fixture(scope="module")
def one_process(model_cache: Path) -> Callable[[str], dict[str, Any]]:
    """Metrics and weights of one process training on the whole batch, per scenario."""
    results: dict[str, dict[str, Any]] = {}

    def get(scenario: str) -> dict[str, Any]:
        if scenario not in results:
            cfg = train_config(scenario)
            model, ref_model, value_head = build_models(model_cache, scenario)
            batch = make_batch(model.config.vocab_size, shared_prompts=SCENARIOS[scenario].shared_prompts)
            samples = single_process_order(batch, cfg)
            optimizer = build_optimizer(model, cfg, value_head)
            threads = torch.get_num_threads()
            # One thread, as each rank has: on a busy 2-core machine two spinning OpenMP threads
            # make this tiny update ~100x slower.
            torch.set_num_threads(1)
            try:
                metrics = train_on_batch(model, samples, cfg, optimizer, ref_model=ref_model, value_head=value_head)
            finally:
                torch.set_num_threads(threads)
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            if value_head is not None:
                weights.update({f"value_head.{n}": p.detach().clone() for n, p in value_head.named_parameters()})
            initial, _, _ = build_models(model_cache, scenario)
            results[scenario] = {
                "metrics": metrics,
                "weights": weights,
                "initial": dict(initial.named_parameters()),
                "trainable": {n for n, p in initial.named_parameters() if p.requires_grad},
                "lr": cfg.learning_rate,
            }
        return results[scenario]

    return get


def _launch(strategy: str, model_cache: Path, out_dir: Path) -> dict[str, Any]:
    scenarios, ds_config = LAUNCHES[strategy]
    out = out_dir / "results.pt"
    args = ["--strategy", strategy, "--scenarios", *scenarios, "--cache-dir", str(model_cache)]
    run = run_ranks(WORKER, [*args, "--out", str(out), "--ds-config", json.dumps(ds_config)], processes=WORLD_SIZE)
    assert run.returncode == 0, f"{strategy} ranks failed:\n{output(run)[-8000:]}"
    return torch.load(out)


def _assert_matches(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got["metrics"]) == set(want["metrics"])
    for key, value in want["metrics"].items():
        if key not in ("perf/seconds", "perf/tokens_per_s"):
            assert got["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert set(got["weights"]) == set(want["weights"])
    lr = want["lr"]
    for name, weight in want["weights"].items():
        if name in want["trainable"]:  # the update is not trivial: every trained tensor moved by about 2 steps
            assert (weight - want["initial"][name]).abs().max() > lr, name
        torch.testing.assert_close(got["weights"][name], weight, atol=0.02 * lr, rtol=0, msg=name)


@pytest.mark.parametrize("scenario", LAUNCHES["fsdp2"][0])
def test_fsdp2_on_two_ranks_matches_one_process(
    launched: Callable[[str], dict[str, Any]], one_process: Callable[[str], dict[str, Any]], scenario: str
) -> None:
    _assert_matches(launched("fsdp2")[scenario], one_process(scenario))


@pytest.mark.timeout(1800)  # on a fresh environment the first launch JIT-builds DeepSpeed's ops
@pytest.mark.parametrize(
    ("strategy", "scenario"),
    [(strategy, scenario) for strategy in ("zero2-offload", "zero3-offload") for scenario in LAUNCHES[strategy][0]],
)
def test_deepspeed_on_two_ranks_matches_one_process(
    launched: Callable[[str], dict[str, Any]],
    one_process: Callable[[str], dict[str, Any]],
    strategy: str,
    scenario: str,
) -> None:
    # The test extra installs DeepSpeed: missing, it fails here rather than skipping.
    assert importlib.util.find_spec("deepspeed"), "DeepSpeed is missing: pip install -e '.[test]' installs it"
    _assert_matches(launched(strategy)[scenario], one_process(scenario))


def _samples(group_sizes: list[int]) -> list[Sample]:
    groups = [f"g{i}" for i, size in enumerate(group_sizes) for _ in range(size)]
    batch = make_batch(vocab=50, n=len(groups))
    return [dataclasses.replace(s, group_id=g) for s, g in zip(batch, groups, strict=True)]


def test_shard_samples_gives_each_rank_whole_groups_in_equal_counts() -> None:
    batch = _samples([2, 2, 1, 3])
    shares = [shard_samples(batch, rank, 2) for rank in range(2)]
    assert [[s.group_id for s in share] for share in shares] == [["g0", "g0", "g1", "g1"], ["g2", "g3", "g3", "g3"]]
    assert shard_samples(batch, 0, 1) == batch
    with pytest.raises(ValueError, match="without splitting a group"):
        shard_samples(_samples([3, 3, 2]), 0, 2)
    with pytest.raises(ValueError, match="divide evenly"):
        shard_samples(_samples([2, 1]), 0, 2)
    with pytest.raises(ValueError, match="rank 2"):
        shard_samples(batch, 2, 2)


def test_deepspeed_config_leaves_accumulation_to_the_caller() -> None:
    cfg = train_config("grpo")
    config = deepspeed_config(cfg, zero_stage=3, offload_optimizer=True)
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_accumulation_steps"] == 1
    assert config["gradient_clipping"] == cfg.max_grad_norm
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert config["optimizer"]["params"]["lr"] == cfg.learning_rate
    assert "fp16" not in config and "bf16" not in config  # fp32 weights and optimizer
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(cfg, zero_stage=0, offload_optimizer=False)


def test_missing_deepspeed_and_launcher_are_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'spotrl\[deepspeed\]'"):
        _import_deepspeed()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_distributed()


def test_exit_rank_flushes_what_the_rank_wrote_and_keeps_its_code() -> None:
    program = (
        "import logging, sys\n"
        "from trainer_core.rl.distributed import exit_rank\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
        "logging.getLogger('job').info('published v3')\n"
        "print('result written', end='')\n"  # no newline: still in stdout's buffer
        "exit_rank(3)\n"
        "print('not reached')\n"
    )
    run = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3
    assert run.stdout == "result written"
    assert "published v3" in run.stderr
