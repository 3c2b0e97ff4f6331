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
from collections import deque
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
# before one on-demand worker measures the rate (without one there is nothing to size a purchase by).
UNMEASURED_DEADLINE_SHARE = 0.25
# The latest safe moment to buy: on-demand workers bought then would finish with this share of the
# time left to spare, and ``SLACK_SECONDS`` more (the pace window's lag, a preemption's lost groups).
SAFETY = 0.1
SLACK_SECONDS = 1800.0


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
    pool_workers: int = 0  # the pool the policy holds for the backlog (the trainer's pace before a job's time is known)


@dataclass(frozen=True)
class DeadlineCall:
    """``on_demand_workers`` to hold beside the spot pool; ``reason`` is what the run shows for it."""

    on_demand_workers: int
    reason: str


class SpotProgress:
    """One run's ``(time, samples its spot workers have made so far)`` points, the last two pace
    windows' worth: what ``spot_pace`` reads. The scheduler keeps one per run, the simulator one."""

    def __init__(self) -> None:
        self._points: deque[tuple[float, int]] = deque()

    def record(self, now: float, made: int) -> tuple[tuple[float, int], ...]:
        """Add ``made`` at ``now``, forget points older than two windows; the points, oldest first."""
        self._points.append((now, made))
        while self._points[0][0] < now - 2 * PACE_WINDOW_SECONDS:
            self._points.popleft()
        return tuple(self._points)


def spot_pace(points: Sequence[tuple[float, int]], since: float, now: float) -> float | None:
    """Samples per second spot workers made from ``since`` to ``now``, from the ``(time, samples
    so far)`` points (oldest first): from the first point at or after ``since`` to the last one.
    None when the points cover less than ``MIN_PACE_SECONDS`` of the window."""
    inside = [(t, n) for t, n in points if since <= t <= now]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < MIN_PACE_SECONDS:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return max(0, n1 - n0) / (t1 - t0)


def finish_seconds(v: DeadlineView, rate: float, startup: bool = True) -> float:
    """Seconds from now to the run's end with rollout at ``rate`` samples/s (``startup``: new workers
    start up first): the samples left made, then the last batch trained; or, when training is the
    slower, the next batch made, then every job left trained; a cold training start either way."""
    if rate <= 0:
        return math.inf
    job = v.training_seconds or 0.0
    to_make = max(0, v.still_needed - v.queued_for_next)
    first = max(0, v.batch_samples - v.queued_for_next)
    up = v.startup_seconds if startup else 0.0
    return up + max(to_make / rate + job, min(first, to_make) / rate + _training_left(v)) + v.startup_seconds


def _training_left(v: DeadlineView) -> float:
    job = v.training_seconds or 0.0
    iterations_left = math.ceil(v.still_needed / v.batch_samples)
    running = max(0.0, job - v.training_running_for) if v.training_running_for is not None else 0.0
    return iterations_left * job + running


def deadline_call(v: DeadlineView) -> DeadlineCall:
    """The on-demand rollout workers a run holds to meet its deadline.

    On-demand rollout costs the same per sample however many workers make it, and every sample
    spot makes first is one it need not buy; a trickle of on-demand workers, though, makes a batch
    so slowly that every job starts cold. So the rule waits for spot as long as the deadline
    allows, and when it buys, buys a pool that keeps the trainer busy:

    1. training alone (the jobs left, one after the other) would miss the deadline: no rollout
       bought can meet it, nothing is bought and the reason says so;
    2. spot's pace over the last ``PACE_WINDOW_SECONDS`` (the start-up excluded) and one worker's
       measured rate give ``finish_seconds``, the time to the end at a given rollout rate;
    3. nothing held: nothing is bought while on-demand workers bought now would still finish
       within ``SAFETY`` of the time left (the latest safe moment not reached);
    4. at that moment it buys the workers that, beside spot's pace, make the larger of the
       deadline's pace (with ``HYSTERESIS``) and the trainer's (a batch per job:
       ``batch / training_seconds``, the pool cost-aware holds), at most ``max_workers``;
    5. held: kept (topped up if spot's pace fell) until spot alone would finish within
       ``HYSTERESIS`` of the time left, then all given back.

    An example, the seed's workload (batches of 5000, a worker at 0.83 samples/s, 1080 s jobs,
    90 s start-ups, at most 16 workers), 12 h deadline, no spot at all: nothing is bought while
    six workers (5000 / (0.83 x 1080)) bought now would finish 12 batches with 10% to spare,
    about 5.5 h before the deadline; then six are bought, a batch every 17 minutes, and the
    training node stays warm.

    Before any worker's rate is measured, one on-demand worker is bought once
    ``UNMEASURED_DEADLINE_SHARE`` of the deadline went by without a spot sample (a zone without
    spot capacity): it measures the rate, and is given back if the latest safe moment is still
    far (``HYSTERESIS`` beyond it), or kept and joined by the others once it comes.
    """
    time_left = v.started_at + v.deadline_seconds - v.now
    to_make = max(0, v.still_needed - v.queued_for_next)
    if to_make == 0:
        return DeadlineCall(0, "every sample the run needs is made")
    job = v.training_seconds or 0.0
    iterations_left = math.ceil(v.still_needed / v.batch_samples)
    training_left = _training_left(v)
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
    measured_pace = spot_pace(
        v.spot_progress, max(v.now - PACE_WINDOW_SECONDS, v.started_at + v.startup_seconds), v.now
    )
    if rate is None:
        spot_made = v.spot_progress[-1][1] if v.spot_progress else 0
        elapsed = v.now - v.started_at
        if spot_made == 0 and elapsed >= max(v.startup_seconds, UNMEASURED_DEADLINE_SHARE * v.deadline_seconds):
            return DeadlineCall(
                max(1, v.on_demand_workers),
                f"no spot sample in {elapsed:.0f} s: an on-demand worker measures the rate the rule sizes by",
            )
        return DeadlineCall(v.on_demand_workers, "waiting for spot capacity: no rate measured yet")
    pace = measured_pace or 0.0
    trainer = min(v.max_workers * rate, v.batch_samples / job) if job else v.pool_workers * rate
    target = max(need * (1 + HYSTERESIS), trainer)
    bought = max(0, min(v.max_workers, math.ceil((target - pace) / rate - 1e-9)))
    spot_alone = finish_seconds(v, pace, startup=False)
    with_bought = finish_seconds(v, pace + bought * rate)
    if v.on_demand_workers > 0 and measured_pace is None:
        # Workers held and no window of spot progress: a scheduler that has just (re)started
        # keeps what its predecessor bought until it has measured the pace again.
        return DeadlineCall(
            v.on_demand_workers, f"keeping {v.on_demand_workers} on-demand workers while the spot pace is measured"
        )
    if v.on_demand_workers > 0:
        surplus = time_left - with_bought * (1 + SAFETY) - SLACK_SECONDS  # beyond the latest safe moment
        if job and surplus > max(HYSTERESIS * time_left, 2 * PACE_WINDOW_SECONDS):
            return DeadlineCall(
                0,
                f"waiting for spot ({pace:.2f}/s): {bought} on-demand workers bought later would still finish in "
                f"{with_bought:.0f} s of the {time_left:.0f} s left; the ones held go back",
            )
        if spot_alone * (1 + HYSTERESIS) <= time_left:
            return DeadlineCall(
                0,
                f"spot alone ({pace:.2f}/s) finishes in {spot_alone:.0f} s of the {time_left:.0f} s left: "
                "the on-demand workers go back",
            )
        # Until a job's time is known the deadline's pace alone sizes them (the probe's batch measures it).
        fewest = max(0, min(v.max_workers, math.ceil((max(need, trainer if job else 0.0) - pace) / rate - 1e-9)))
        held = min(max(v.on_demand_workers, fewest), max(fewest, bought if job else fewest))
        return DeadlineCall(
            held,
            f"keeping {held} on-demand workers: pace {pace:.2f}/s from spot, need {need:.2f}/s "
            f"({to_make} samples in {window:.0f} s), the trainer takes {trainer:.2f}/s",
        )
    if measured_pace is None and v.now - v.started_at < v.startup_seconds + MIN_PACE_SECONDS:
        return DeadlineCall(0, "measuring the spot pace")
    # Without a job's time the finish is a guess: spot is waited for as long as for a first sample.
    patient = v.now - v.started_at < UNMEASURED_DEADLINE_SHARE * v.deadline_seconds
    if patient if not job else with_bought * (1 + SAFETY) + SLACK_SECONDS < time_left:
        return DeadlineCall(
            0,
            f"waiting for spot ({pace:.2f}/s): {bought} on-demand workers bought now would finish in "
            f"{with_bought:.0f} s of the {time_left:.0f} s left",
        )
    return DeadlineCall(
        bought,
        f"buying {bought} on-demand workers: pace {pace:.2f}/s from spot, need {need:.2f}/s "
        f"({to_make} samples in {window:.0f} s), the trainer takes {trainer:.2f}/s",
    )
