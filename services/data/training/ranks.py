"""A training job's processes: one, or the ranks of a torchrun pod, which take every collective
step alike (the leader reads and writes the queue and the object store, and shares what the
others need)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from trainer_core.rl.distributed import DistEnv, all_reduce, broadcast_object, init_distributed

_T = TypeVar("_T")


@dataclass(frozen=True)
class Ranks:
    """This job process's place among the job's processes (`env` None: the only one)."""

    env: DistEnv | None

    @classmethod
    def join(cls, processes: int) -> Ranks:
        if processes == 1:
            return cls(None)
        env = init_distributed()
        if env.world_size != processes:
            raise RuntimeError(
                f"the run spec asks for {processes} training processes, torchrun started {env.world_size}"
            )
        return cls(env)

    @property
    def leader(self) -> bool:
        return self.env is None or self.env.rank == 0

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
