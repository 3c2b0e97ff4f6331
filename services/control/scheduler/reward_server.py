"""The run's reward server in the scheduler's plan (the spec's ``reward_server``): pure, like ``plan``.

A run whose spec asks for one has a reward service pod (``<run>-reward``, role ``reward``) on the
spec's instance type (a small GPU, T4/L4 class), billed in the ledger like any pod, from the run's
start to its end. It serves the run's one reward term with a `path` (a user's function, or a
reward model) and writes where it listens into the state store (``runs.reward_url``); rollout
workers and eval pods read it there and send it their responses. A pod that ends (a spot node
taken back, a crash) is reaped and launched again the next tick under the same name: scoring
waits meanwhile, nothing is lost. It stops with the run's other pods, but for a run that lets its
evals finish: the reward server then stays while an eval pod does.

Example: a run starts; the first tick launches ``<run>-reward`` beside the rollout pool; the
workers wait for its address, then score through it; its spot node is taken back: the next tick
reaps it (its ledger entry closed, ``preempted``), the one after launches it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.control.scheduler.run_state import RunState
from services.domain.names import ROLE_REWARD
from services.ports.launcher.launcher import PodStatus


@dataclass(frozen=True)
class LaunchRewardServer:
    """Start the run's reward server pod."""

    run_id: str


def reward_server_due(run: RunState, alive: Sequence[PodStatus]) -> list[LaunchRewardServer]:
    """The launch of the run's reward server, when its spec asks for one and none runs."""
    if run.spec.reward_server is None or any(p.role == ROLE_REWARD for p in alive):
        return []
    return [LaunchRewardServer(run.run_id)]


def serving_evals(alive: Sequence[PodStatus], kept: Sequence[PodStatus]) -> list[PodStatus]:
    """The reward server pods to keep beside the eval pods ``kept`` running at the run's end."""
    return [p for p in alive if p.role == ROLE_REWARD] if kept else []
