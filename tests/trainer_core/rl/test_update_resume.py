"""An update interrupted after a checkpoint and resumed from it ends as the uninterrupted update:
the same weights, optimizer state and metrics, bit for bit, on one process (LocalStrategy) and
on 2 FSDP2 ranks (torchrun, gloo on CPU: `resume_worker.py`).

The update of `resume_worker.resumable_config` takes 4 optimizer steps, 2 epochs of 2 shuffled
mini-batches, with a KL term (a reference that differs from the policy), clipping and several
micro-batches per step; interrupted after step K, the resumed update must take the remaining
steps in the interrupted one's order and from its exact state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_worker import WORLD_SIZE, build_models, make_batch
from resume_worker import STEPS, DirectoryCheckpoint, Interrupted, flat_optimizer_state, resumable_config

from tests.torchrun import output, run_ranks
from trainer_core.models.loading import load_policy
from trainer_core.rl.resume import WEIGHTS_FILE
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch

WORKER = Path(__file__).with_name("resume_worker.py")
# Timings: the only metrics a resumed update reports for its own part.
TIMINGS = {"perf/seconds", "perf/tokens_per_s"}


def _update(model_cache: Path, scenario: str, checkpoint: DirectoryCheckpoint | None, **changes: Any) -> dict[str, Any]:
    """One process's update of `scenario` on fresh models (as a new job has), with `checkpoint`
    (and `changes` to its config)."""
    cfg = resumable_config(scenario).model_copy(update=changes)
    model, ref_model, value_head = build_models(model_cache, scenario)
    optimizer = build_optimizer(model, cfg, value_head)
    samples = make_batch(model.config.vocab_size)
    metrics = train_on_batch(
        model, samples, cfg, optimizer, ref_model=ref_model, value_head=value_head, checkpoint=checkpoint
    )
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if value_head is not None:
        weights.update({f"value_head.{n}": p.detach().clone() for n, p in value_head.named_parameters()})
    return {"metrics": metrics, "weights": weights, "optimizer": flat_optimizer_state(optimizer.state_dict()["state"])}


def _assert_same_update(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: metrics (but timings), weights and the optimizer's state."""
    assert {k: v for k, v in got["metrics"].items() if k not in TIMINGS} == {
        k: v for k, v in want["metrics"].items() if k not in TIMINGS
    }
    assert got["weights"].keys() == want["weights"].keys()
    for name, weight in want["weights"].items():
        assert torch.equal(got["weights"][name], weight), name
    assert got["optimizer"].keys() == want["optimizer"].keys() and want["optimizer"]
    for name, value in want["optimizer"].items():
        assert torch.equal(got["optimizer"][name], value), name


@pytest.mark.parametrize(
    ("scenario", "at"),
    [("grpo", 1), ("grpo", 2), ("ppo", 3), ("grpo-lora", 3), ("grpo-shared-prompts", 2)],
    ids=["grpo-after-1", "grpo-at-epoch-end", "ppo-after-3", "lora-after-3", "shared-prompts-after-2"],
)
def test_a_resumed_update_ends_as_the_uninterrupted_one(
    model_cache: Path, tmp_path: Path, scenario: str, at: int
) -> None:
    want = _update(model_cache, scenario, None)
    initial, _, _ = build_models(model_cache, scenario)
    moved = [n for n, p in initial.named_parameters() if not torch.equal(p, want["weights"][n])]
    assert moved, "the update moved the policy"

    interrupted = DirectoryCheckpoint(tmp_path, at={at}, stop_after=at)
    with pytest.raises(Interrupted):
        _update(model_cache, scenario, interrupted)
    assert interrupted.asked == list(range(1, at + 1)), "asked after each step"
    checkpoint = tmp_path / f"step-{at}"
    assert interrupted.saved == [checkpoint]
    # Only what trains is saved: a LoRA policy's adapter, not its base (the pre-update model's).
    saved = torch.load(checkpoint / WEIGHTS_FILE, weights_only=True)
    assert saved.keys() == {n for n, p in initial.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in saved) == ("lora" in scenario)

    resumed = DirectoryCheckpoint(tmp_path / "again", resume_from=checkpoint)
    got = _update(model_cache, scenario, resumed)
    # The steps before the checkpoint are skipped, and none is asked for after the last.
    assert resumed.asked == list(range(at + 1, STEPS))
    _assert_same_update(got, want)


def test_checkpoints_are_taken_when_due_and_a_later_one_resumes_further(model_cache: Path, tmp_path: Path) -> None:
    want = _update(model_cache, "grpo", None)
    every = DirectoryCheckpoint(tmp_path, at={1, 3})
    assert _update(model_cache, "grpo", every)["metrics"]["actor/pg_loss"] == want["metrics"]["actor/pg_loss"]
    assert every.saved == [tmp_path / "step-1", tmp_path / "step-3"]
    resumed = DirectoryCheckpoint(tmp_path / "again", resume_from=tmp_path / "step-3")
    _assert_same_update(_update(model_cache, "grpo", resumed), want)
    assert resumed.asked == [], "steps 1-3 were skipped, and step 4 is the last"


def test_no_checkpoint_is_taken_after_the_last_step(model_cache: Path, tmp_path: Path) -> None:
    """There the update ends, and its caller keeps the result: a checkpoint would never be loaded."""
    every = DirectoryCheckpoint(tmp_path, at=set(range(1, STEPS + 1)))
    _update(model_cache, "grpo", every)
    assert every.asked == list(range(1, STEPS))
    assert every.saved == [tmp_path / f"step-{k}" for k in range(1, STEPS)]


def test_a_checkpoint_after_the_last_step_resumes_to_the_end(model_cache: Path, tmp_path: Path) -> None:
    """An update resumed from a checkpoint of its last step (as an earlier release took) takes no
    step and ends as the uninterrupted one. Step 2 of 4 is the last of the same update in one
    epoch, whose steps are the first epoch's."""
    with pytest.raises(Interrupted):
        _update(model_cache, "grpo", DirectoryCheckpoint(tmp_path, at={2}, stop_after=2))
    want = _update(model_cache, "grpo", None, epochs=1)
    resumed = DirectoryCheckpoint(tmp_path / "again", resume_from=tmp_path / "step-2")
    _assert_same_update(_update(model_cache, "grpo", resumed, epochs=1), want)
    assert resumed.asked == []


def test_a_checkpoint_of_a_longer_update_is_refused(model_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(Interrupted):
        _update(model_cache, "grpo", DirectoryCheckpoint(tmp_path, at={3}, stop_after=3))
    cfg = resumable_config("grpo").model_copy(update={"epochs": 1})  # 2 steps
    model, ref_model, _ = build_models(model_cache, "grpo")
    with pytest.raises(ValueError, match="step 3, this update takes 2 steps"):
        train_on_batch(
            model,
            make_batch(model.config.vocab_size),
            cfg,
            build_optimizer(model, cfg),
            ref_model=ref_model,
            checkpoint=DirectoryCheckpoint(tmp_path, resume_from=tmp_path / "step-3"),
        )


# strategy -> (scenarios, DeepSpeed config overrides). ZeRO-3 partitions every parameter of the
# tiny model at a persistence threshold of 0, as test_distributed runs it. DeepSpeed's engines are
# slow to build: its launches take the critic (ppo, with a KL term) and a LoRA adapter only.
LAUNCHES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "fsdp2": (["grpo", "ppo", "grpo-lora"], {}),
    "zero2-offload": (["ppo", "grpo-lora"], {}),
    "zero3-offload": (["ppo", "grpo-lora"], {"zero_optimization": {"stage3_param_persistence_threshold": 0}}),
}


@pytest.mark.timeout(1800)  # on a fresh environment the first DeepSpeed launch JIT-builds its ops
@pytest.mark.parametrize("strategy", sorted(LAUNCHES))
def test_two_ranks_resume_as_they_would_have_gone_on(model_cache: Path, tmp_path: Path, strategy: str) -> None:
    load_policy("tiny", cache_dir=model_cache)  # built once here, not by both ranks at once
    out = tmp_path / "results.pt"
    args = ["--strategy", strategy, "--scenarios", *LAUNCHES[strategy][0], "--at", "3", "--cache-dir", str(model_cache)]
    args += ["--out", str(out), "--ds-config", json.dumps(LAUNCHES[strategy][1])]
    run = run_ranks(WORKER, args, processes=WORLD_SIZE)
    assert run.returncode == 0, f"ranks failed:\n{output(run)[-8000:]}"
    results = torch.load(out, weights_only=True)
    assert set(results) == set(LAUNCHES[strategy][0])
    for scenario, runs in results.items():
        assert set(runs) == {"uninterrupted", "resumed", "loaded"}, scenario
        assert runs["resumed"]["asked"] == [], "steps 1-3 were skipped, and step 4 is the last"
        _assert_same_update(runs["resumed"], runs["uninterrupted"])
        # load_full_state_dict on its own: the trained weights in a fresh strategy's parameters,
        # and in ZeRO's fp32 masters (which its optimizer's next step starts from).
        loaded, trained = runs["loaded"], runs["uninterrupted"]["weights"]
        assert loaded["weights"].keys() <= trained.keys()
        for name, weight in loaded["weights"].items():
            assert torch.equal(weight, trained[name]), name
        assert bool(loaded["masters"]) == strategy.startswith("zero")
        for name, master in loaded["masters"].items():
            assert torch.equal(master, trained[name]), name
