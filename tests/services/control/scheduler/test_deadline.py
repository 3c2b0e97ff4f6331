"""The deadline rule (``services.control.scheduler.deadline``) on hand-built observations: the
seed's workload (batches of 5000, a worker at 0.83 samples/s, 1080 s jobs, 90 s start-ups)."""

from __future__ import annotations

from dataclasses import replace

from services.control.scheduler.deadline import HYSTERESIS, DeadlineView, deadline_call

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
    assert call.on_demand_workers == 0 and not call.whole_pool


def test_the_workers_bought_close_the_shortfall_and_no_more() -> None:
    # 12 h deadline, 3 h in, 35,000 to make (2000 queued): 33,000 / 31,140 s = 1.06/s needed.
    # Spot at 0.5/s is 0.56 short: one worker; at 0.1/s 0.96 short: two. Never the whole pool.
    behind = view(3.0, 12.0, 35_000, spot_per_s=0.5, queued_for_next=2000)
    assert deadline_call(behind).on_demand_workers == 1
    assert (
        deadline_call(replace(behind, spot_progress=((behind.now - 1800, 0), (behind.now, 180)))).on_demand_workers == 2
    )
    assert "1.06/s" in deadline_call(behind).reason


def test_workers_go_back_once_spot_is_on_pace_with_a_margin_against_flapping() -> None:
    need = 33_000 / 31_140
    held = view(3.0, 12.0, 35_000, spot_per_s=0.5, queued_for_next=2000, on_demand_workers=2)

    def at(pace: float) -> int:
        return deadline_call(
            replace(held, spot_progress=((held.now - 1800, 0), (held.now, round(pace * 1800))))
        ).on_demand_workers

    assert at(0.2) == 2  # still short by more than a worker: both kept
    assert at(need * 1.05) == 1  # on pace, inside the margin: one kept (what 1.25 x need asks of it)
    assert at(need * (1 + HYSTERESIS) + 0.01) == 0  # spot alone has the margin: all back
    # One worker held at a pace just over the need stays: no launch and stop every tick.
    assert (
        deadline_call(
            replace(
                held, on_demand_workers=1, spot_progress=((held.now - 1800, 0), (held.now, round(need * 1.05 * 1800)))
            )
        ).on_demand_workers
        == 1
    )


def test_when_training_alone_misses_the_deadline_no_rollout_is_bought_and_the_reason_says_so() -> None:
    # 10 h into a 12 h deadline, 7 iterations left and a job 300 s in: 780 + 7 x 1080 s = 2.3 h of
    # training for 2 h. Spot makes nothing, yet today's rule would buy the whole pool.
    call = deadline_call(view(10.0, 12.0, 35_000, spot_per_s=0.0, training_running_for=300.0))
    assert call.on_demand_workers == 0 and not call.whole_pool
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


def test_without_a_rate_the_whole_pool_goes_on_demand_after_a_quarter_of_the_deadline() -> None:
    nothing = view(1.0, 8.0, 60_000, spot_per_s=0.0, worker_samples_per_s=None, spot_progress=((0.0, 0), (HOUR, 0)))
    assert not deadline_call(nothing).whole_pool
    assert deadline_call(replace(nothing, now=2 * HOUR)).whole_pool
