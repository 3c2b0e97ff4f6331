"""One rank of `test_update_resume`'s data-parallel cases, run under torchrun: per scenario, an uninterrupted
update, the same update interrupted after a checkpoint at step K, and a third resumed from that
checkpoint, each on fresh models and a fresh strategy (as a new job would); rank 0 saves each
one's metrics, whole weights and optimizer state.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/trainer_core/rl/resume_worker.py \
        --strategy fsdp2 --scenarios grpo ppo --at 3 --cache-dir CACHE --out OUT

`DirectoryCheckpoint` and `resumable_config` serve the one-process tests too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from dist_worker import SCENARIOS, build_models, make_batch, train_config
from torch import nn

from contracts.training import TrainConfig

STEPS = 4  # resumable_config's optimizer steps: 2 epochs of 2 mini-batches


class Interrupted(Exception):
    """The update ended after a checkpoint, as a job killed then would."""


class DirectoryCheckpoint:
    """An `UpdateCheckpoint` in a local directory: it checkpoints after each step in `at` into
    `root/step-<k>`, raises `Interrupted` once step `stop_after` is saved, and resumes from
    `resume_from` (a directory it saved). `asked` lists the steps after which the update asked
    whether one is due: each it took but its last (after which it takes no checkpoint)."""

    def __init__(
        self, root: Path, at: set[int] = frozenset(), stop_after: int | None = None, resume_from: Path | None = None
    ) -> None:
        if stop_after is not None and stop_after >= STEPS:
            raise ValueError(f"an update of {STEPS} steps takes no checkpoint after step {STEPS}: it never stops there")
        self.root, self.at, self.stop_after, self.resume_from = root, at, stop_after, resume_from
        self.saved: list[Path] = []
        self.asked: list[int] = []

    def restore(self) -> Path | None:
        return self.resume_from

    def due(self, steps: int) -> bool:
        self.asked.append(steps)
        return steps in self.at

    def save(self, steps: int, write: Callable[[Path], None]) -> None:
        directory = self.root / f"step-{steps}"
        directory.mkdir(parents=True, exist_ok=True)  # every rank: the same directory
        write(directory)
        self.saved.append(directory)
        if steps == self.stop_after:
            raise Interrupted(f"after step {steps}")


def resumable_config(scenario: str) -> TrainConfig:
    """`dist_worker.train_config` over STEPS steps of shuffled mini-batches: 2 epochs of 2 mini-batches
    of 8 samples (each epoch's order seeded), so a resumed update must take the same order."""
    return train_config(scenario).model_copy(update={"epochs": 2, "shuffle": True, "seed": 7})


def build_strategy(name: str, model: nn.Module, cfg: TrainConfig, value_head, ref_model, ds_config: dict) -> Any:
    """`fsdp2`, or DeepSpeed's `zero<stage>[-offload]` as dist_worker builds them."""
    from trainer_core.rl.fsdp2 import FSDP2Strategy
    from trainer_core.rl.zero import DeepSpeedStrategy

    if name == "fsdp2":
        return FSDP2Strategy(model, cfg, value_head=value_head, ref_model=ref_model)
    stage, _, offload = name.removeprefix("zero").partition("-")
    return DeepSpeedStrategy(
        model,
        cfg,
        zero_stage=int(stage),
        offload_optimizer=offload == "offload",
        value_head=value_head,
        ref_model=ref_model,
        config_overrides=ds_config,
    )


def flat_optimizer_state(state: dict[Any, dict[str, Any]], prefix: str = "") -> dict[str, torch.Tensor]:
    """A torch optimizer's `state_dict()["state"]` as {"<param>.<key>": tensor}."""
    return {f"{prefix}{param}.{key}": torch.as_tensor(v) for param, s in state.items() for key, v in s.items()}


def optimizer_tensors(strategy: Any, model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The strategy's whole optimizer state by name (a collective), from what `save_optimizer_state`
    wrote into `directory`: FSDP2's file holds it whole; ZeRO's partitions are gathered per
    parameter with DeepSpeed's tensor-fragment API, its fp32 master weights with them."""
    from trainer_core.rl.fsdp2 import FSDP2Strategy
    from trainer_core.rl.strategy import OPTIMIZER_FILE

    if isinstance(strategy, FSDP2Strategy):
        saved = torch.load(directory / OPTIMIZER_FILE, weights_only=True) if strategy.rank == 0 else {}
        actor, critic = saved.get("actor", {}).get("state", {}), saved.get("critic", {"state": {}})["state"]
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        actor = {
            name: {
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
                "fp32": safe_get_full_fp32_param(p),
            }
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        critic_file = directory / "critic_optimizer.pt"
        critic = torch.load(critic_file, weights_only=True)["state"] if critic_file.exists() else {}
    return flat_optimizer_state(actor) | flat_optimizer_state(critic, "critic.")


def loaded(args: argparse.Namespace, scenario: str, cfg: TrainConfig, weights: dict[str, torch.Tensor]) -> dict:
    """A fresh strategy's whole weights after `load_full_state_dict` of the trainable ones of
    `weights` (rank 0's only), and, under ZeRO, its fp32 master weights, which a step writes back
    over the parameters."""
    model, ref_model, value_head = build_models(args.cache_dir, scenario)
    strategy = build_strategy(args.strategy, model, cfg, value_head, ref_model, args.ds_config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    strategy.load_full_state_dict({name: weights[name] for name in trainable} if strategy.rank == 0 else {})
    masters = {}
    if args.strategy != "fsdp2":
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {name: safe_get_full_fp32_param(p) for name, p in model.named_parameters() if p.requires_grad}
    return {"weights": strategy.full_state_dict(), "masters": masters}


def main() -> None:
    import torch.distributed as dist

    from trainer_core.rl.distributed import exit_rank, init_distributed, shard_samples
    from trainer_core.rl.update import train_on_batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)  # fsdp2 | zero2-offload | zero3-offload ...
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--at", type=int, required=True)  # the step after which the update is interrupted
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ds-config", type=json.loads, default={})  # DeepSpeed config overrides
    args = parser.parse_args()

    torch.set_num_threads(1)
    env = init_distributed()
    results: dict[str, dict[str, Any]] = {}
    for scenario in args.scenarios:
        cfg = resumable_config(scenario)
        for run in ("uninterrupted", "interrupted", "resumed"):
            model, ref_model, value_head = build_models(args.cache_dir, scenario)
            strategy = build_strategy(args.strategy, model, cfg, value_head, ref_model, args.ds_config)
            samples = shard_samples(make_batch(model.config.vocab_size), env.rank, env.world_size)
            root = args.out.parent / f"checkpoints-{scenario}"
            checkpoint = {
                "uninterrupted": None,
                "interrupted": DirectoryCheckpoint(root, at={args.at}, stop_after=args.at),
                "resumed": DirectoryCheckpoint(root, resume_from=root / f"step-{args.at}"),
            }[run]
            try:
                metrics = train_on_batch(
                    model, samples, cfg, strategy, ref_model=ref_model, value_head=value_head, checkpoint=checkpoint
                )
            except Interrupted:
                dist.barrier()  # every rank's part of the checkpoint is written
                continue
            weights = strategy.full_state_dict()
            if value_head is not None:
                weights.update({f"value_head.{n}": p.detach().clone() for n, p in value_head.named_parameters()})
            optimizer_dir = args.out.parent / f"optimizer-{scenario}-{run}"
            optimizer_dir.mkdir(exist_ok=True)
            strategy.save_optimizer_state(optimizer_dir)
            dist.barrier()  # rank 0's files are written
            results.setdefault(scenario, {})[run] = {
                "metrics": metrics,
                "weights": weights,
                "optimizer": optimizer_tensors(strategy, model, optimizer_dir),
                "asked": checkpoint.asked if checkpoint is not None else [],
            }
        results[scenario]["loaded"] = loaded(args, scenario, cfg, results[scenario]["uninterrupted"]["weights"])
    if env.rank == 0:
        torch.save(results, args.out)
    exit_rank()  # as a training job's ranks end


if __name__ == "__main__":
    sys.exit(main())
