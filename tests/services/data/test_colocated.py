from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from services.cli.main import app
from services.data.colocated import (
    IterationRecord,
    ResumeError,
    SpecFileError,
    load_spec_file,
    run_colocated,
    stop_reason,
)
from services.domain.runspec import RunSpec
from services.ports.prices.catalog import load_catalog
from trainer_core.models.checkpoint import list_checkpoints
from trainer_core.models.loading import load_policy

SPEC = {
    "model": "tiny",
    "algorithm": "grpo",
    "prompts": [{"prompt": f"say {c}:", "answer": str(i)} for i, c in enumerate("abc")],
    # Rewards every "a" written: the untrained tiny model sometimes does, so advantages are non-zero.
    "reward": [{"fn": "regex", "pattern": "a"}, {"fn": "exact_match", "weight": 0.5}],
    "samples_per_prompt": 4,
    "sampling": {"temperature": 1.0, "max_new_tokens": 8},
    "batch_samples": 16,  # 4 prompts an iteration: the 3-prompt set cycles
    "iterations": 2,
    "rollout": {"prompts_per_batch": 3},  # generated in chunks of 3 + 1 prompts
    "training": {"instance_type": "p4d.24xlarge", "learning_rate": 1e-2, "micro_batch": 8},
}


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "models"  # shared with the other tests of a session


@pytest.fixture(scope="module")
def straight_run(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> tuple[Path, list[IterationRecord], object]:
    """An uninterrupted 2-iteration run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("straight")
    seen: list[IterationRecord] = []
    result = run_colocated(
        RunSpec.model_validate(SPEC), out_dir=out, model_cache=model_cache, seed=5, on_iteration=seen.append
    )
    return out, seen, result


def _weights(policy_dir: Path, model_cache: Path) -> dict[str, torch.Tensor]:
    return load_policy(policy_dir, cache_dir=model_cache).model.state_dict()


def test_a_colocated_run_checkpoints_every_iteration_and_writes_a_loadable_policy(
    straight_run: tuple[Path, list[IterationRecord], object], model_cache: Path
) -> None:
    out, seen, result = straight_run
    assert [r.iteration for r in seen] == [1, 2] and result.iterations == seen
    assert result.stop_reason == "iterations"
    assert all(r.samples == 16 and 0 <= r.mean_reward <= 1.5 for r in seen)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000001", "step-00000002"]

    # Every batch is on-policy: the rollout sampled from the very weights being trained, so the
    # single optimizer step of an iteration sees ratio 1 (a stale copy would show a KL > 0 in
    # iteration 2).
    assert all(abs(r.metrics["actor/ppo_kl"]) < 1e-5 and r.metrics["actor/pg_clipfrac"] == 0 for r in seen)

    trained = _weights(result.policy_dir, model_cache)
    base = load_policy("tiny", cache_dir=model_cache).model.state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    last = _weights(out / "checkpoints" / "step-00000002" / "policy", model_cache)
    assert all(torch.equal(trained[k], last[k]) for k in trained)

    # Billed for its wall time on the spec's training instance, on-demand (the arithmetic: below).
    price = load_catalog().get("p4d.24xlarge").on_demand
    assert (result.cost.instance_type, result.cost.price_per_hour, result.cost.currency) == (
        "p4d.24xlarge",
        price,
        "USD",
    )
    assert result.cost.wall_seconds > 0


def test_the_cost_line_bills_wall_seconds_at_the_hourly_price() -> None:
    from services.data.colocated import CostLine

    half_hour = CostLine(instance_type="x9.test", price_per_hour=2.0, currency="USD", wall_seconds=1800.0)
    assert half_hour.dollars == pytest.approx(1.00)  # 1800 s at $2.00/h
    assert str(half_hour) == "cost: 1800.0 s wall x 2.0000 USD/h (x9.test, on-demand) = 1.0000 USD"
    assert CostLine("x9.test", 21.96, "USD", wall_seconds=90.0).dollars == pytest.approx(0.549)  # 90 s at $21.96/h


def test_a_resumed_run_ends_with_the_same_weights(
    straight_run: tuple[Path, list[IterationRecord], object], model_cache: Path, tmp_path: Path
) -> None:
    spec = RunSpec.model_validate(SPEC)

    class Killed(Exception):
        pass

    def die_after_first(record: IterationRecord) -> None:
        raise Killed  # after iteration 1's checkpoint is written

    with pytest.raises(Killed):
        run_colocated(spec, out_dir=tmp_path, model_cache=model_cache, seed=5, on_iteration=die_after_first)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000001"]
    with pytest.raises(ResumeError, match="resume"):
        run_colocated(spec, out_dir=tmp_path, model_cache=model_cache, seed=5)

    torch.manual_seed(1234)  # as a new process would start: the run's RNG streams come from the checkpoint
    random.seed(1234)
    seen: list[IterationRecord] = []
    result = run_colocated(
        spec, out_dir=tmp_path, model_cache=model_cache, resume=True, seed=5, on_iteration=seen.append
    )
    assert [r.iteration for r in seen] == [2]
    assert [r.iteration for r in result.iterations] == [1, 2]

    straight_out, straight_seen, _ = straight_run
    assert [r.mean_reward for r in result.iterations] == [r.mean_reward for r in straight_seen]
    resumed, straight = _weights(result.policy_dir, model_cache), _weights(straight_out / "policy", model_cache)
    assert [k for k in straight if not torch.equal(resumed[k], straight[k])] == []


def test_resume_may_change_the_goal_but_nothing_else(
    straight_run: tuple[Path, list[IterationRecord], object], model_cache: Path, tmp_path: Path
) -> None:
    shutil.copytree(straight_run[0] / "checkpoints", tmp_path / "checkpoints")
    other = RunSpec.model_validate({**SPEC, "training": {**SPEC["training"], "learning_rate": 1e-3}})
    with pytest.raises(ResumeError, match="different run spec"):
        run_colocated(other, out_dir=tmp_path, model_cache=model_cache, resume=True)

    longer = RunSpec.model_validate({**SPEC, "iterations": 3})
    seen: list[IterationRecord] = []
    result = run_colocated(longer, out_dir=tmp_path, model_cache=model_cache, resume=True, on_iteration=seen.append)
    assert [r.iteration for r in seen] == [3] and len(result.iterations) == 3


def test_runs_stop_at_the_target_reward_or_the_budget() -> None:
    def record(i: int, reward: float) -> IterationRecord:
        return IterationRecord(iteration=i, mean_reward=reward, samples=16, rollout_seconds=1.0, train_seconds=1.0)

    spec = RunSpec.model_validate({**SPEC, "iterations": 5, "target_mean_reward": 0.5, "budget_dollars": 1.0})
    assert stop_reason(spec, []) is None
    assert stop_reason(spec, [record(1, 0.2)], dollars=0.5) is None
    assert stop_reason(spec, [record(1, 0.2), record(2, 0.5)]) == "target_mean_reward"
    assert stop_reason(spec, [record(1, 0.2)], dollars=1.0) == "budget_dollars"
    assert stop_reason(spec, [record(i, 0.1) for i in range(1, 6)]) == "iterations"


def test_spec_files_are_read_from_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(SPEC))
    (tmp_path / "spec.yaml").write_text("model: tiny\niterations: 1\nprompts:\n  - prompt: 'say a:'\n    answer: '1'\n")
    assert load_spec_file(tmp_path / "spec.json") == RunSpec.model_validate(SPEC)
    assert load_spec_file(tmp_path / "spec.yaml").iterations == 1

    (tmp_path / "bad.yaml").write_text("model: [tiny\n")
    (tmp_path / "bad.json").write_text(json.dumps({**SPEC, "batch_samples": 6}))
    with pytest.raises(SpecFileError, match="not valid YAML"):
        load_spec_file(tmp_path / "bad.yaml")
    with pytest.raises(SpecFileError, match="multiple of samples_per_prompt"):
        load_spec_file(tmp_path / "bad.json")
    with pytest.raises(SpecFileError, match="cannot read"):
        load_spec_file(tmp_path / "missing.yaml")
    # What only the disaggregated loop does is refused from a colocated spec file, saying so.
    (tmp_path / "dapo.json").write_text(json.dumps({**SPEC, "training": {"dynamic_sampling": True}}))
    with pytest.raises(SpecFileError, match="submit the spec as a disaggregated run"):
        load_spec_file(tmp_path / "dapo.json")


def test_train_command(tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "spotrl serve" in result.output and "POST /v1/runs" in result.output

    monkeypatch.setenv("SPOTRL_MODEL_CACHE", str(model_cache))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: tiny\niterations: 1\nsamples_per_prompt: 2\nbatch_samples: 4\n"
        "sampling: {max_new_tokens: 4}\nprompts:\n  - {prompt: 'say a:', answer: '1'}\n"
    )
    args = ["train", "--colocated", str(spec), "--out", str(tmp_path / "out"), "--home", str(tmp_path / "home")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "iteration 1: mean reward" in result.output
    assert "cost:" in result.output and "p4d.24xlarge, on-demand" in result.output
    assert (tmp_path / "out" / "policy" / "model.safetensors").is_file()

    result = runner.invoke(app, args)  # the same directory again, without --resume
    assert result.exit_code == 2 and "resume" in result.output


def test_a_lora_run_checkpoints_the_adapter_and_writes_a_merged_policy(tmp_path: Path, model_cache: Path) -> None:
    spec = RunSpec.model_validate(
        SPEC | {"iterations": 1, "training": SPEC["training"] | {"lora_rank": 4, "kl_coef": 0.1}}
    )
    result = run_colocated(spec, out_dir=tmp_path, model_cache=model_cache, seed=5)
    checkpoint = list_checkpoints(tmp_path / "checkpoints")[-1] / "policy"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    trained = _weights(result.policy_dir, model_cache)  # a plain model directory: the adapter merged in
    base = load_policy("tiny", cache_dir=model_cache).model.state_dict()
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)
