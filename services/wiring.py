"""Opens the backends a process needs, from its settings (embedded adapters for now)."""

from __future__ import annotations

from dataclasses import dataclass

from services.backends.launcher import Launcher, LocalLauncher
from services.backends.object_store import LocalObjectStore, ObjectStore
from services.backends.queue import Queue
from services.backends.reward_cache import RewardCache, SqliteRewardCache
from services.backends.sqlite_queue import SqliteQueue
from services.backends.state_store import StateStore
from services.config import Settings


@dataclass
class Backends:
    state: StateStore
    queue: Queue
    objects: ObjectStore
    rewards: RewardCache
    launcher: Launcher

    def close(self) -> None:
        self.queue.close()
        self.rewards.close()
        self.state.close()


def open_backends(settings: Settings) -> Backends:
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    return Backends(
        state=StateStore(settings.resolved_state_url()),
        queue=SqliteQueue(home / "queue.db"),
        objects=LocalObjectStore(home / "objects"),
        rewards=SqliteRewardCache(home / "reward-cache.db"),
        launcher=LocalLauncher(home / "pods"),
    )
