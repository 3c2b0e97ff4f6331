"""A training job's processes: one, or the ranks of a torchrun pod (on one machine or on several
nodes), which take every collective step alike (the leader reads and writes the queue and the
object store, and shares what the others need; each machine's first rank moves what its ranks
read and write between its disk and the object store)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from trainer_core.rl.distributed import DistEnv, all_reduce, broadcast_object, init_distributed

_T = TypeVar("_T")


@dataclass(frozen=True)
class Ranks:
    """This job process's place among the job's processes (`env` None: the only one)."""

    env: DistEnv | None
    node: int = 0  # which of the job's machines this process runs on (torchrun's GROUP_RANK)

    @classmethod
    def join(cls, ranks: int) -> Ranks:
        """Join the job's `ranks` processes (processes x nodes of the run spec)."""
        if ranks == 1:
            return cls(None)
        env = init_distributed()
        if env.world_size != ranks:
            raise RuntimeError(
                f"the run spec asks for {ranks} training processes (processes x nodes), torchrun started "
                f"{env.world_size}"
            )
        return cls(env, int(os.environ.get("GROUP_RANK", "0")))

    @property
    def leader(self) -> bool:
        return self.env is None or self.env.rank == 0

    @property
    def node_leader(self) -> bool:
        """The first process of its machine: it moves its machine's files to and from the object store."""
        return self.env is None or self.env.local_rank == 0

    def on_disk(self, path: Path) -> Path:
        """This machine's folder for `path`, which its ranks share: node k > 0 of a job of several
        adds its number, so that nodes that share a disk (the embedded launcher's) keep apart."""
        return path if self.node == 0 else path.with_name(f"{path.name}-node{self.node}")

    @property
    def rank(self) -> int:
        return 0 if self.env is None else self.env.rank

    @property
    def world_size(self) -> int:
        return 1 if self.env is None else self.env.world_size

    @property
    def device(self) -> torch.device:
        """The device this process trains on: its GPU under torchrun with CUDA, else the CPU."""
        return torch.device("cpu") if self.env is None else self.env.device

    def share(self, obj: _T | None) -> _T:
        """The leader's `obj` on every rank (a collective, so also a barrier)."""
        return obj if self.env is None else broadcast_object(obj)

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective)."""
        return value if self.env is None else int(all_reduce(torch.tensor(value), "min", self.env.device))
