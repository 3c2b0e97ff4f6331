"""Opens the backends a process needs, from its settings: each port's adapter is chosen by its
URL (``SPOTRL_QUEUE_URL``, ``SPOTRL_REWARD_CACHE_URL``, ``SPOTRL_OBJECTS_URL``,
``SPOTRL_STATE_URL``); unset means the embedded adapter under ``SPOTRL_HOME``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def open_queue(url: str | None, home: Path) -> Queue:
    return SqliteQueue(home / "queue.db")


def open_reward_cache(url: str | None, home: Path) -> RewardCache:
    return SqliteRewardCache(home / "reward-cache.db")


def open_object_store(url: str | None, home: Path) -> ObjectStore:
    return LocalObjectStore(home / "objects")


def open_backends(settings: Settings) -> Backends:
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    return Backends(
        state=StateStore(settings.resolved_state_url()),
        queue=open_queue(settings.queue_url, home),
        objects=open_object_store(settings.objects_url, home),
        rewards=open_reward_cache(settings.reward_cache_url, home),
        launcher=LocalLauncher(home / "pods"),
    )
