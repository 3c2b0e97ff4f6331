"""Where a simulated run's dollars above the lower bound go (``bench/cost_policies.py --explain``).

The lower bound pays each role's busy seconds for the work trained, and nothing else; every pod
the run paid for is split into what the bound leaves out:

- ``train_startup``: training and standby pods' start-ups (node start plus model load);
- ``train_idle``: a training node up and not training (a standby held while the batch fills, or
  the node between two pods that hand it over, which ``services.control.cost.billing`` bills);
- ``roll_startup``: rollout workers' start-ups;
- ``roll_idle``: rollout workers up without a prompt to work on;
- ``roll_waste``: generation never trained (groups lost to a preemption, stale, or left over at
  the end), the on-demand premium of rollout generation, and on a trace with prices, generation
  paid above the trace's cheapest spot price (the bound's);
- ``billing``: the provider's minimum and rounding (``services.control.cost.billing``), and training work
  that was not a trained batch.

The parts sum to the run's dollars less its lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from services.control.cost.billing import HANDOVER_SECONDS

PARTS = ("train_startup", "train_idle", "roll_startup", "roll_idle", "roll_waste", "billing")


@dataclass(frozen=True)
class PodSpan:
    """One pod's billed life, as the simulator saw it."""

    rollout: bool
    started_at: float
    ready_at: float  # start-up done (at once on a warm node)
    ended_at: float
    busy_seconds: float  # generating (a worker) or training (a job)
    price_per_hour: float


def gap(pods: Sequence[PodSpan], dollars: float, rollout_bound: float, training_bound: float) -> dict[str, float]:
    """The run's ``dollars`` above the bound (``rollout_bound + training_bound``), split by ``PARTS``."""
    parts = dict.fromkeys(PARTS, 0.0)
    busy = {True: 0.0, False: 0.0}
    for pod in pods:
        per_s = pod.price_per_hour / 3600.0
        startup = max(0.0, min(pod.ready_at, pod.ended_at) - pod.started_at)
        idle = max(0.0, pod.ended_at - pod.started_at - startup - pod.busy_seconds)
        role = "roll" if pod.rollout else "train"
        parts[f"{role}_startup"] += startup * per_s
        parts[f"{role}_idle"] += idle * per_s
        busy[pod.rollout] += pod.busy_seconds * per_s
    nodes = sorted((pod for pod in pods if not pod.rollout), key=lambda pod: pod.started_at)
    for before, after in pairwise(nodes):
        if 0.0 <= after.started_at - before.ended_at <= HANDOVER_SECONDS:  # one machine, billed between its pods
            parts["train_idle"] += (after.started_at - before.ended_at) * after.price_per_hour / 3600.0
    parts["roll_waste"] = busy[True] - rollout_bound
    # What the seconds above leave out: minimums, rounding, and training busy beyond the trained batches.
    parts["billing"] = dollars - rollout_bound - training_bound - sum(parts.values())
    return parts


def forced_training_startups(
    iterations: int,
    batch_samples: int,
    spot_workers: int,
    worker_samples_per_s: float,
    training_seconds: float,
    startup_seconds: float,
    staleness_bound: int = 1,
) -> int:
    """The training start-ups a policy pays whatever it does, with at most ``spot_workers`` making
    samples (rollout on spot only) and its wall time kept near threshold's: the first job's, and
    later ones where the next batch takes longer to make than a job trains by more than a start-up
    (holding the node for that wait costs more than a restart): every job's with a staleness bound
    of 0, else one per pair of jobs trained back to back on one node (the second batch made while
    the first waits, one version old when trained)."""
    if spot_workers <= 0:
        return iterations
    wait = batch_samples / (spot_workers * worker_samples_per_s) - training_seconds
    if wait <= startup_seconds:
        return min(1, iterations)
    return iterations if staleness_bound == 0 else min(iterations, 1 + math.ceil((iterations - 1) / 2))
