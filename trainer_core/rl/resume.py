"""Checkpoints within one update, so that an interrupted update (a preempted spot node) resumes
where it got to and ends as the uninterrupted one would have.

`train_on_batch` takes an `UpdateCheckpoint`, the caller's hook that decides when to checkpoint
and where a checkpoint is kept. After each optimizer step but the last (the update ends there)
the update asks it whether a checkpoint is `due`; if so, every rank writes the update's state into a local directory
(`write_update_state`) and the hook stores it (`save`). An update that starts with a checkpoint
(`restore`) first scores the batch with the model it was given, the pre-update one (old and
reference log-probs, values: `rl.batch.prepare_batch`, as an uninterrupted update does), then
loads the checkpoint (`read_update_state`) and skips the steps already taken. Each epoch's
mini-batch order is seeded (`cfg.seed + epoch`), so the remaining steps are those the
interrupted update would have taken: the same weights, optimizer state and metrics, bit for
bit on one process.

A checkpoint directory holds (the ranks of a pod write into one directory on their shared disk):

- ``progress-rank<r>.pt``, one per rank: the steps taken, that rank's metric totals (before the
  reduction over ranks), the gradient norms so far, and the RNG states;
- ``weights.pt`` (rank 0): the policy's trainable parameters, whole (`Strategy.full_state_dict`;
  a LoRA policy's adapter only, its base is the pre-update model's);
- ``value_head.pt`` (rank 0, PPO): the critic's weights;
- ``optimizer/``: the strategy's optimizer state (`Strategy.save_optimizer_state`), the critic's
  included.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from trainer_core.rl.critic import ValueHead
from trainer_core.rl.strategy import Strategy

WEIGHTS_FILE = "weights.pt"
VALUE_HEAD_FILE = "value_head.pt"
OPTIMIZER_DIR = "optimizer"


def progress_file(rank: int) -> str:
    return f"progress-rank{rank}.pt"


class UpdateCheckpoint(Protocol):
    """Where and when an update checkpoints: the caller's side of `train_on_batch(checkpoint=...)`.
    Each method is called on every rank alike, so it may take collective steps."""

    def restore(self) -> Path | None:
        """The local directory of the checkpoint to resume from (as `write_update_state` wrote it,
        readable by every rank), or None to start at step 0. Called once, after the batch is scored."""
        ...

    def due(self, steps: int) -> bool:
        """Whether to checkpoint now, after `steps` optimizer steps; the same answer on every rank."""
        ...

    def save(self, steps: int, write: Callable[[Path], None]) -> None:
        """Keep a checkpoint of the update after `steps` steps: make an empty local directory
        (one path on every rank of a machine), call `write(directory)` on every rank (a
        collective that fills it), and store what it holds. May then end the update by raising
        (a job asked to stop exits once its checkpoint is stored)."""
        ...


@dataclass
class UpdateProgress:
    """How far an update got: what `train_on_batch` accumulates over its optimizer steps."""

    steps: int = 0
    # Metric sums over this rank's micro-batches (`update._mini_batch_step`), not yet reduced over ranks.
    totals: dict[str, Tensor] = field(default_factory=dict)
    grad_norms: list[Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, device: torch.device) -> UpdateProgress:
        """No step taken: totals that start at 0 on `device` for any key."""
        return cls(totals=defaultdict(lambda: torch.zeros((), device=device)))


def write_update_state(
    directory: Path, progress: UpdateProgress, strategy: Strategy, model: nn.Module, critic: ValueHead | None
) -> None:
    """Write the update's state after `progress.steps` steps into `directory` (module docstring);
    a collective: call it on every rank with the same `directory`."""
    (directory / OPTIMIZER_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "steps": progress.steps,
            "totals": {key: value.cpu() for key, value in progress.totals.items()},
            "grad_norms": [norm.cpu() for norm in progress.grad_norms],
            "rng": _rng_state(),
        },
        directory / progress_file(strategy.rank),
    )
    # Only the parameters that train: a frozen one (a LoRA adapter's base) is still the pre-update model's.
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    weights = {name: w for name, w in strategy.full_state_dict().items() if name in trainable}
    if strategy.rank == 0:
        torch.save({name: w.cpu() for name, w in weights.items()}, directory / WEIGHTS_FILE)
        if critic is not None:  # whole on every rank (one process, or `ReplicatedCritic`)
            torch.save({k: v.cpu() for k, v in critic.state_dict().items()}, directory / VALUE_HEAD_FILE)
    del weights
    strategy.save_optimizer_state(directory / OPTIMIZER_DIR)


def read_update_state(
    directory: Path, strategy: Strategy, critic: ValueHead | None, device: torch.device
) -> UpdateProgress:
    """Load what `write_update_state` wrote into `directory` into the strategy's model and
    optimizer and the critic, and return the progress it records (a collective)."""
    saved = torch.load(directory / progress_file(strategy.rank), weights_only=True)
    weights = torch.load(directory / WEIGHTS_FILE, weights_only=True) if strategy.rank == 0 else {}
    strategy.load_full_state_dict(weights)
    del weights
    if critic is not None:
        critic.load_state_dict(torch.load(directory / VALUE_HEAD_FILE, weights_only=True))
    strategy.load_optimizer_state(directory / OPTIMIZER_DIR)
    _set_rng_state(saved["rng"])
    progress = UpdateProgress.start(device)
    progress.steps = saved["steps"]
    progress.totals.update({key: value.to(device) for key, value in saved["totals"].items()})
    progress.grad_norms = [norm.to(device) for norm in saved["grad_norms"]]
    return progress


def _rng_state() -> dict[str, Tensor]:
    """The RNG states a step may draw from (dropout): the CPU's, and the current GPU's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
