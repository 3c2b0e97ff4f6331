"""The deadline rule of the cost-aware policy: how many on-demand rollout workers a run with a
``deadline_seconds`` holds beside its spot pool, and why (``deadline_call``, a pure function).

It buys only what closes the gap: the spot pool's pace over a recent window, the pace the
samples still to make need to meet the deadline, and one worker's measured rate give the
on-demand workers needed; they are given back once spot alone is back on pace, with a margin
(``HYSTERESIS``) so that the count does not flap. Training is on the critical path too: when the
jobs still to train alone would miss the deadline, no rollout bought can meet it, and the rule
says so instead of buying.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The spot pace is measured over this many recent seconds (more than one batch-and-job cycle of the
# seed's workload: 25 minutes of rollout for an 18 minute job), the run's start-up excluded.
PACE_WINDOW_SECONDS = 1800.0
# A window shorter than this measures no pace yet (a few groups would give a noisy one).
MIN_PACE_SECONDS = 300.0
# On-demand workers are given back only once spot alone makes this much more than the pace needed.
HYSTERESIS = 0.25
# Before any worker's rate is measured, the share of the deadline the run waits for spot capacity
# before its pool goes on-demand whole (without a rate there is nothing to size a share by).
UNMEASURED_DEADLINE_SHARE = 0.25


@dataclass(frozen=True)
class DeadlineView:
    """What the deadline rule reads (times in seconds, on the scheduler's clock)."""

    deadline_seconds: float  # from the run's start
    started_at: float
    now: float
    batch_samples: int
    still_needed: int  # samples the iterations not yet trained or training need (the queued ones among them)
    queued_for_next: int  # samples made and queued for the next batch
    spot_progress: Sequence[tuple[float, int]]  # (time, samples spot workers have made so far), oldest first
    worker_samples_per_s: float | None  # one worker's rate while generating (None: none measured yet)
    training_seconds: float | None  # one job's (None: none measured yet)
    training_running_for: float | None  # seconds the running job has run (None: no job runs)
    startup_seconds: float
    on_demand_workers: int  # on-demand rollout workers held now
    max_workers: int


@dataclass(frozen=True)
class DeadlineCall:
    """``on_demand_workers`` to hold beside the spot pool; ``whole_pool``: no rate to size them by
    yet, and spot gave nothing for too long, so the whole pool goes on-demand. ``reason`` is what
    the run shows for it."""

    on_demand_workers: int
    reason: str
    whole_pool: bool = False


def spot_pace(points: Sequence[tuple[float, int]], since: float, now: float) -> float | None:
    """Samples per second spot workers made from ``since`` to ``now``, from the ``(time, samples
    so far)`` points (oldest first): from the first point at or after ``since`` to the last one.
    None when the points cover less than ``MIN_PACE_SECONDS`` of the window."""
    inside = [(t, n) for t, n in points if since <= t <= now]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < MIN_PACE_SECONDS:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return max(0, n1 - n0) / (t1 - t0)


def deadline_call(v: DeadlineView) -> DeadlineCall:
    """The on-demand rollout workers a run holds to meet its deadline.

    An example, the seed's workload (batches of 5000 samples, a worker makes 0.83 samples/s, a
    job trains 1080 s, start-ups 90 s, at most 16 workers) with a 12 h deadline, 3 h in, 7
    iterations (35,000 samples) still to make and train, 2000 of them queued, no job running:

    1. training alone needs 7 x 1080 s = 2.1 h of the 9 h left: rollout can still decide;
    2. the last batch trains after it is made, and a new worker and the last job each start up:
       the 33,000 samples to make have 9 h - 1080 s - 2 x 90 s = 31,140 s, 1.06 samples/s;
    3. spot made 0.5 samples/s over the last 30 minutes (an outage cut the pool): 0.56 short,
       ``ceil(0.56 / 0.83)`` = 1 on-demand worker. Start-up and an outage of the first hours no
       longer count once out of the window; a run that started late is not late for ever;
    4. spot recovers to 2.5 samples/s: the worker goes back once spot alone makes 1.25 x 1.06;
       between 1.06 and 1.33 the count is kept (``HYSTERESIS``), so a pace near the need does
       not launch and stop a worker every tick;
    5. 10 h in, 5 iterations left, a job running for 300 s: training needs 780 + 5 x 1080 s =
       1.7 h of the 2 h left, fine; with 7 left it would need 2.3 h: no rollout meets that, so
       no worker is bought and the reason says training is the bottleneck.

    Before a pace is measured (``MIN_PACE_SECONDS`` of window after the start-up) nothing is
    bought; before any worker's rate is, the whole pool goes on-demand once
    ``UNMEASURED_DEADLINE_SHARE`` of the deadline went by without a spot sample (a zone without
    spot capacity), and the workers are then sized as above once they have measured a rate.
    """
    time_left = v.started_at + v.deadline_seconds - v.now
    to_make = max(0, v.still_needed - v.queued_for_next)
    if to_make == 0:
        return DeadlineCall(0, "every sample the run needs is made")
    job = v.training_seconds or 0.0
    iterations_left = math.ceil(v.still_needed / v.batch_samples)
    training_left = iterations_left * job + (
        max(0.0, job - v.training_running_for) if v.training_running_for is not None else 0.0
    )
    if job and training_left > time_left:
        return DeadlineCall(
            0,
            f"training is the bottleneck: {iterations_left} iterations of {job:.0f} s each need "
            f"{training_left:.0f} s, {max(0.0, time_left):.0f} s are left to the deadline; "
            "more rollout would not meet it, so none is bought",
        )
    # The last batch is trained after it is made; a new worker and the last job each start up first.
    window = time_left - job - 2 * v.startup_seconds
    if window <= 0:
        return DeadlineCall(0, f"{max(0.0, time_left):.0f} s left cannot make and train a batch; none bought")
    need = to_make / window
    rate = v.worker_samples_per_s
    pace = spot_pace(v.spot_progress, max(v.now - PACE_WINDOW_SECONDS, v.started_at + v.startup_seconds), v.now)
    if rate is None:
        spot_made = v.spot_progress[-1][1] if v.spot_progress else 0
        elapsed = v.now - v.started_at
        if spot_made == 0 and elapsed >= max(v.startup_seconds, UNMEASURED_DEADLINE_SHARE * v.deadline_seconds):
            return DeadlineCall(
                v.on_demand_workers,
                f"no spot sample in {elapsed:.0f} s: the pool goes on-demand until a rate is measured",
                whole_pool=True,
            )
        return DeadlineCall(v.on_demand_workers, "waiting for spot capacity: no rate measured yet")
    if pace is None:
        return DeadlineCall(v.on_demand_workers, "measuring the spot pace")
    fewest = math.ceil((need - pace) / rate)  # to be on pace
    most = math.ceil((need * (1 + HYSTERESIS) - pace) / rate)  # beyond this spot alone has a margin
    held = min(max(v.on_demand_workers, fewest), max(fewest, most))
    held = max(0, min(v.max_workers, held))
    return DeadlineCall(
        held,
        f"{to_make} samples in {window:.0f} s need {need:.2f}/s; spot made {pace:.2f}/s over the last "
        f"{min(PACE_WINDOW_SECONDS, v.now - v.started_at - v.startup_seconds):.0f} s; "
        f"{held} on-demand workers at {rate:.2f}/s each",
    )
