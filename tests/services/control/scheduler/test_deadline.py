"""The deadline rule (``services.control.scheduler.deadline``) on hand-built observations: the
seed's workload (batches of 5000, a worker at 0.83 samples/s, 1080 s jobs, 90 s start-ups)."""

from __future__ import annotations

from dataclasses import replace

from services.control.scheduler.deadline import DeadlineView, deadline_call

HOUR = 3600.0
RATE = 3000.0 / HOUR  # one worker's samples per second


def view(hours_in: float, deadline_hours: float, still_needed: int, spot_per_s: float, **changes) -> DeadlineView:
    """``hours_in`` hours into the run, spot having made ``spot_per_s`` over the last 30 minutes."""
    now = hours_in * HOUR
    base = 10_000
    return replace(
        DeadlineView(
            deadline_seconds=deadline_hours * HOUR,
            started_at=0.0,
            now=now,
            batch_samples=5000,
            still_needed=still_needed,
            queued_for_next=0,
            spot_progress=((now - 1800, base), (now, base + round(spot_per_s * 1800))),
            worker_samples_per_s=RATE,
            training_seconds=1080.0,
            training_running_for=None,
            startup_seconds=90.0,
            on_demand_workers=0,
            max_workers=16,
        ),
        **changes,
    )


def test_an_early_outage_does_not_make_a_run_on_pace_look_late() -> None:
    # 12 h deadline; no spot for the first 4 h, 10,000 samples in the hour since: 2.8/s. The 50,000
    # left need 50,000 / (7 h - 1080 s - 180 s) = 2.1/s. Pace since the start (0.56/s) projects a
    # finish at 5 h + 25 h: today's rule would buy; over the recent window it is on pace.
    call = deadline_call(view(5.0, 12.0, 50_000, spot_per_s=10_000 / HOUR))
    assert call.on_demand_workers == 0


def test_spot_is_waited_for_until_the_latest_safe_moment_then_a_pool_that_keeps_the_trainer_busy() -> None:
    # 12 h deadline, 3 h in, 35,000 to make (2000 queued), spot at 0.5/s: five workers (5000 /
    # 1080 s = 4.63/s, less spot's pace) would finish in 2.3 h of the 9 h left: nothing bought yet.
    behind = view(3.0, 12.0, 35_000, spot_per_s=0.5, queued_for_next=2000)
    call = deadline_call(behind)
    assert call.on_demand_workers == 0 and "waiting for spot" in call.reason
    # 9.5 h in, the same: past the latest safe moment. 33,000 in 7740 s need 4.26/s, 1.25 x that
    # less spot's 0.5/s is six workers; never a trickle (a batch every 100 minutes starts every job cold).
    late = deadline_call(replace(behind, now=9.5 * HOUR, spot_progress=((9.5 * HOUR - 1800, 0), (9.5 * HOUR, 900))))
    assert late.on_demand_workers == 6 and late.reason.startswith("buying 6 on-demand workers")


def test_workers_held_stay_until_spot_alone_finishes_with_a_margin() -> None:
    held = view(9.5, 12.0, 35_000, spot_per_s=0.5, queued_for_next=2000, on_demand_workers=5)

    def at(pace: float) -> int:
        return deadline_call(
            replace(held, spot_progress=((held.now - 1800, 0), (held.now, round(pace * 1800))))
        ).on_demand_workers

    assert at(0.5) == 5  # kept
    assert at(0.0) == 6  # spot stopped: topped up to the trainer's pace
    assert at(20.0) == 0  # spot alone finishes in 33,000 / 20 + 7 x 1080 s, well within the 2.5 h left


def test_when_training_alone_misses_the_deadline_no_rollout_is_bought_and_the_reason_says_so() -> None:
    # 10 h into a 12 h deadline, 7 iterations left and a job 300 s in: 780 + 7 x 1080 s = 2.3 h of
    # training for 2 h. Spot makes nothing, yet today's rule would buy the whole pool.
    call = deadline_call(view(10.0, 12.0, 35_000, spot_per_s=0.0, training_running_for=300.0))
    assert call.on_demand_workers == 0
    assert "training is the bottleneck" in call.reason
    # With 5 left (1.7 h of training) rollout decides again, and spot making nothing needs workers.
    assert deadline_call(view(10.0, 12.0, 25_000, spot_per_s=0.0, training_running_for=300.0)).on_demand_workers > 0


def test_a_slow_start_does_not_make_a_48_hour_run_look_late() -> None:
    # 1200 s into a 48 h run, spot capacity came at 1100 s and made 400 samples since: 0.33/s from
    # the start projects 1200 + 59,600 / 0.33 + 1080 s, past 48 h, and today's rule buys. Measured
    # after the 90 s start-up: 0.36/s, over the 0.35/s the 60,000 samples need. Nothing to buy.
    now = 1200.0
    call = deadline_call(
        replace(
            view(now / HOUR, 48.0, 60_000, spot_per_s=0.0), spot_progress=((0.0, 0), (90.0, 0), (1100.0, 0), (now, 400))
        )
    )
    assert call.on_demand_workers == 0


def test_without_a_rate_one_worker_measures_it_after_a_quarter_of_the_deadline() -> None:
    nothing = view(1.0, 8.0, 60_000, spot_per_s=0.0, worker_samples_per_s=None, spot_progress=((0.0, 0), (HOUR, 0)))
    assert deadline_call(nothing).on_demand_workers == 0
    assert deadline_call(replace(nothing, now=2 * HOUR)).on_demand_workers == 1


def test_a_restarted_scheduler_keeps_the_workers_held_until_it_has_measured_the_pace() -> None:
    # The pace history lives in the scheduler's memory: one that has just started has a single
    # point. It keeps the five workers its predecessor held rather than count spot as making nothing.
    restarted = view(9.5, 12.0, 35_000, spot_per_s=0.5, queued_for_next=2000, on_demand_workers=5)
    restarted = replace(restarted, spot_progress=restarted.spot_progress[-1:])
    call = deadline_call(restarted)
    assert call.on_demand_workers == 5 and "while the spot pace is measured" in call.reason
