"""The state store's contract, on both adapters: SQLite (embedded) and PostgreSQL (a real server,
tests/servers/postgres.py). Concurrency under contention is in test_state_store_concurrency.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

from contracts.evaluation import EvalResult
from contracts.status import TRANSITIONS, RunStatus
from services.ports.state.state_store import EvalProgress, IllegalTransitionError, RunNotFoundError, StateStore
from tests.iteration_rows import iteration_row


def test_status_transitions(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    assert store.get_run("r1").status == "PENDING"
    store.set_status("r1", RunStatus.RUNNING)
    assert store.get_run("r1").started_at is not None
    with pytest.raises(IllegalTransitionError, match="RUNNING; it cannot become SUCCEEDED"):
        store.set_status("r1", RunStatus.SUCCEEDED)  # an end goes through ENDING: pods stop first
    store.begin_ending("r1", RunStatus.SUCCEEDED, "done")
    row = store.get_run("r1")
    assert (row.status, row.status_reason, row.ending_status, row.ended_at) == ("ENDING", "done", "SUCCEEDED", None)
    assert [r.id for r in store.list_runs(active_only=True)] == ["r1"]  # still reconciled
    store.set_status("r1", RunStatus.SUCCEEDED, "done")
    row = store.get_run("r1")
    assert (row.status, row.status_reason) == ("SUCCEEDED", "done")
    assert row.ended_at is not None
    assert store.list_runs(active_only=True) == []
    with pytest.raises(IllegalTransitionError):
        store.set_status("r1", RunStatus.RUNNING)
    with pytest.raises(IllegalTransitionError, match="nothing to cancel"):
        store.request_cancel("r1")
    with pytest.raises(RunNotFoundError):
        store.get_run("nope")


def test_every_status_means_something_and_terminal_ones_go_nowhere() -> None:
    assert set(TRANSITIONS) == set(RunStatus)
    for status in RunStatus:
        assert status.meaning
        assert (TRANSITIONS[status] == frozenset()) == status.is_terminal()
        assert all(status.can_become(nxt) for nxt in TRANSITIONS[status])


def test_cancel_reads_cancelling_until_the_pods_are_gone(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.set_status("r1", RunStatus.RUNNING)
    row = store.request_cancel("r1")
    assert (row.status, row.ending_status, row.status_reason) == ("CANCELLING", "CANCELLED", "cancelled by the user")
    assert store.request_cancel("r1").status == "CANCELLING"  # again: unchanged
    with pytest.raises(IllegalTransitionError):
        store.set_status("r1", RunStatus.RUNNING)  # a late StartRun cannot revive it
    store.set_status("r1", RunStatus.CANCELLED, "cancelled by the user")
    assert store.get_run("r1").status == "CANCELLED"

    store.create_run("r2", name=None, spec={})
    assert store.request_cancel("r2").status_reason == "cancelled before it started"


def test_first_ending_stands_but_a_failure_replaces_it(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.set_status("r1", RunStatus.RUNNING)
    store.begin_ending("r1", RunStatus.SUCCEEDED, "trained 2 iterations")
    assert store.request_cancel("r1").status == "ENDING"  # already stopping: the cancel changes nothing
    assert store.get_run("r1").ending_status == "SUCCEEDED"
    row = store.begin_ending("r1", RunStatus.FAILED, "result missing")
    assert (row.status, row.ending_status, row.ending_reason) == ("ENDING", "FAILED", "result missing")

    store.create_run("r2", name=None, spec={})
    store.request_cancel("r2")
    row = store.begin_ending("r2", RunStatus.FAILED, "broken")
    assert (row.status, row.ending_status) == ("ENDING", "FAILED")
    with pytest.raises(ValueError):
        store.begin_ending("r2", RunStatus.RUNNING, "not an end")


def test_record_iteration_is_atomic_and_idempotent(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    row = dict(kl=0.01, loss=0.1, seconds=3.0, samples_dropped=2)
    store.record_iteration(iteration_row("r1", 1, **row))
    store.record_iteration(iteration_row("r1", 1, **row))
    run = store.get_run("r1")
    assert (run.iterations_done, run.policy_version, run.samples_trained, run.samples_dropped) == (1, 1, 8, 2)
    assert store.policy_version("r1") == 1
    assert [it.iteration for it in store.iterations("r1")] == [1]


def test_ledger_open_close(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    kw = dict(
        run_id="r1",
        role="rollout",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=3.6,
        price_source="test",
    )
    store.open_ledger(pod="p1", started_at=100.0, **kw)
    store.open_ledger(pod="p1", started_at=105.0, **kw)  # idempotent while open
    assert store.open_ledger_count("r1") == 1
    assert store.ledger("r1")[0].dollars(now=200.0) == pytest.approx(0.1)
    assert store.ledger("r1")[0].outcome is None  # running
    store.close_ledger("p1", ended_at=150.0, outcome="killed")
    store.close_ledger("p1", ended_at=190.0, outcome="failed")  # already closed: unchanged
    (entry,) = store.ledger("r1")
    assert (entry.started_at, entry.ended_at, entry.outcome) == (100.0, 150.0, "killed")
    assert entry.dollars(now=10_000.0) == pytest.approx(0.05)
    assert store.open_ledger_count("r1") == 0


def test_worker_reports_add_up_per_worker(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.report_worker("r1", "w0", samples=4, generation_seconds=1.5, reward_cache={"hit": 1, "miss": 3, "error": 0})
    store.report_worker("r1", "w0", samples=2, generation_seconds=0.5, reward_cache={"miss": 2, "error": 2})
    store.report_worker("r1", "w1", samples=8, generation_seconds=2.0, reward_cache={})
    got = {
        w.worker: (
            w.samples_produced,
            w.generation_seconds,
            w.reward_cache_hits,
            w.reward_cache_misses,
            w.reward_cache_errors,
        )
        for w in store.worker_stats("r1")
    }
    assert got == {"w0": (6, 2.0, 1, 5, 2), "w1": (8, 2.0, 0, 0, 0)}
    assert store.worker_stats("other") == []


def test_a_page_of_runs_comes_with_their_ledgers(store: StateStore) -> None:
    """One transaction for a page: each run's entries, oldest first (what they cost is the cost
    engine's billing, not the store's); a run without entries has none."""
    for run_id in ("r1", "r2", "r3"):
        store.create_run(run_id, name=None, spec={})
    kw = dict(role="rollout", instance_type="g6.xlarge", capacity_type="spot", price_source="test")
    store.open_ledger(run_id="r1", pod="a", started_at=100.0, price_per_hour=3.6, **kw)
    store.open_ledger(run_id="r1", pod="b", started_at=100.0, price_per_hour=36.0, **kw)
    store.close_ledger("b", ended_at=110.0)
    store.open_ledger(run_id="r2", pod="c", started_at=500.0, price_per_hour=7.2, **kw)
    page = store.runs_page(tenant=None, limit=10, after=None)
    ledgers = {row.id: [e.pod for e in ledger] for row, ledger in page}
    assert ledgers == {"r1": ["a", "b"], "r2": ["c"], "r3": []}
    assert page[0][1] == store.ledger("r1")
    first, second = (
        store.runs_page(tenant=None, limit=2, after=None),
        store.runs_page(tenant=None, limit=2, after=(page[1][0].created_at, page[1][0].id)),
    )
    assert [r.id for r, _ in first + second] == [r.id for r, _ in page]
    assert store.runs_page(tenant="another", limit=10, after=None) == []


def test_a_run_view_is_its_latest_iterations_their_count_and_its_ledger(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    for n in (1, 2, 3):
        store.record_iteration(iteration_row("r1", n, mean_reward=n / 10, samples_trained=4))
    store.open_ledger(
        run_id="r1",
        pod="a",
        started_at=100.0,
        price_per_hour=3.6,
        role="train",
        instance_type="x",
        capacity_type="on-demand",
        price_source="test",
    )
    view = store.run_view("r1", latest=2)
    assert (view.run.id, view.run.iterations_done) == ("r1", 3)
    assert [it.iteration for it in view.latest] == [2, 3]  # the latest two, oldest first
    assert view.iterations_total == 3 and [e.pod for e in view.ledger] == ["a"]
    assert store.run_view("r1", latest=0).latest == []
    with pytest.raises(RunNotFoundError):
        store.run_view("nope", latest=2)


def test_lease_has_one_holder_until_it_expires_or_is_released(store: StateStore) -> None:
    assert store.acquire_lease("scheduler", "a", seconds=60)
    assert store.acquire_lease("scheduler", "a", seconds=60)  # a renews
    assert not store.acquire_lease("scheduler", "b", seconds=60)
    assert store.acquire_lease("other", "b", seconds=60)  # leases are independent
    store.release_lease("scheduler", "b")  # not b's to release
    assert store.lease_holder("scheduler") == "a"
    store.release_lease("scheduler", "a")
    assert store.lease_holder("scheduler") is None
    assert store.acquire_lease("scheduler", "b", seconds=-1.0)  # b takes it; it runs out at once, as if b died
    assert store.lease_holder("scheduler") is None
    assert store.acquire_lease("scheduler", "a", seconds=60)  # expired: a takes over
    assert not store.acquire_lease("scheduler", "b", seconds=60)  # and b cannot renew what it lost


@pytest.mark.parametrize("expired_lease_exists", [False, True], ids=["insert-race", "update-race"])
def test_lease_contenders_racing_get_one_winner(store_url: str, expired_lease_exists: bool) -> None:
    url = store_url
    if expired_lease_exists:
        with closing(StateStore(url)) as s:
            s.acquire_lease("scheduler", "dead", seconds=-1.0)
    stores = [StateStore(url) for _ in range(6)]  # one per contender, as separate processes would have
    start = threading.Barrier(len(stores))

    def contend(i: int) -> bool:
        start.wait()
        return stores[i].acquire_lease("scheduler", f"holder-{i}", seconds=60)

    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            won = [i for i, ok in enumerate(pool.map(contend, range(len(stores)))) if ok]
        assert len(won) == 1, won
        assert stores[0].lease_holder("scheduler") == f"holder-{won[0]}"
    finally:
        for s in stores:
            s.close()


def test_long_messages_are_clipped_to_their_columns(store: StateStore) -> None:
    """PostgreSQL enforces VARCHAR widths (SQLite does not): a long error must not make the status
    change it comes with fail."""
    store.create_run("r1", name=None, spec={})
    store.set_status("r1", RunStatus.RUNNING)
    store.update_run("r1", last_error="e" * 2000)
    store.count_reward_failures("r1", {"r" * 100: 1}, "r" * 2000)
    store.begin_ending("r1", RunStatus.FAILED, "f" * 2000)
    row = store.get_run("r1")
    assert (row.status, row.ending_status) == ("ENDING", "FAILED")
    assert (row.last_error, row.last_reward_error, row.status_reason, row.ending_reason) == (
        "e" * 500,
        "r" * 500,
        "f" * 500,
        "f" * 500,
    )
    store.set_status("r1", RunStatus.FAILED, "g" * 2000)
    assert store.get_run("r1").status_reason == "g" * 500
    assert store.reward_failures("r1") == {"r" * 64: 1}


def test_reward_failures_add_up_by_reason(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.create_run("r2", name=None, spec={})
    store.count_reward_failures("r1", {"function:timeout": 2, "function:crash": 1}, "function: timeout")
    store.count_reward_failures("r1", {"function:timeout": 3}, "function: timeout")
    store.count_reward_failures("r2", {"code:exception": 1}, "code: ValueError")
    assert store.reward_failures("r1") == {"function:timeout": 5, "function:crash": 1}
    assert store.get_run("r1").reward_failures == 6
    assert store.run_view("r1", latest=1).reward_failures == {"function:timeout": 5, "function:crash": 1}


def test_non_finite_numbers_in_json_are_stored_as_null(store: StateStore) -> None:
    """JSON has no NaN (PostgreSQL refuses it): a NaN metric must not lose the iteration."""
    store.create_run("r1", name=None, spec={"budget": float("inf")})
    row = iteration_row(
        "r1",
        1,
        metrics={"actor/pg_clipfrac": float("nan"), "critic/vf_loss": -float("inf"), "ok": [1.5, float("nan")]},
    )
    store.record_iteration(row)
    (stored,) = store.iterations("r1")
    assert stored.metrics == {"actor/pg_clipfrac": None, "critic/vf_loss": None, "ok": [1.5, None]}
    assert store.get_run("r1").spec == {"budget": None}


def test_timestamps_keep_their_microseconds(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    kw = dict(
        run_id="r1",
        role="rollout",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=3.6,
        price_source="test",
    )
    started = 1_790_000_000.123456
    store.open_ledger(pod="p1", started_at=started, **kw)
    store.close_ledger("p1", ended_at=started + 0.000001)
    (entry,) = store.ledger("r1")
    assert (entry.started_at, entry.ended_at) == (started, started + 0.000001)


def test_closing_before_the_start_bills_nothing(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.open_ledger(
        pod="p1",
        started_at=100.0,
        run_id="r1",
        role="rollout",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=3.6,
        price_source="test",
    )
    store.close_ledger("p1", ended_at=90.0)  # a clock behind the pod's start
    assert store.ledger("r1")[0].ended_at == 100.0


def test_postgresql_url_password_is_never_shown(postgres) -> None:
    url = postgres.new_database()
    with closing(StateStore(url)) as s:
        assert postgres.password in url  # the store gets a real password ...
        assert postgres.password not in s.url and postgres.password not in repr(s)  # ... and shows none
        assert s.url == url.replace(postgres.password, "***")
        assert repr(s) == f"StateStore({s.url!r})"
    secret = "not-the-password-0xC0FFEE"
    wrong = url.replace(postgres.password, secret)
    closed_port = f"postgresql+psycopg://postgres:{secret}@127.0.0.1:1/db"
    for bad, error in (
        (wrong, "password authentication failed"),
        (closed_port, "Connection refused"),
        (closed_port.replace(":1/", ":notaport/"), "invalid literal"),
        (closed_port + "?connect_timeout=x", "connect_timeout"),
    ):
        with pytest.raises(Exception, match=error) as failure:
            StateStore(bad)
        shown = f"{failure.value} {failure.value!r} {failure.value.__cause__!r}"
        assert secret not in shown, shown


def test_deferring_an_entry_only_ever_starts_an_open_one_later(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    kw = dict(
        run_id="r1",
        role="rollout",
        instance_type="g6.xlarge",
        capacity_type="spot",
        price_per_hour=3.6,
        price_source="test",
    )
    store.open_ledger(pod="waited", started_at=100.0, **kw)
    store.defer_ledger("waited", started_at=160.0)  # its node came: billed from then
    store.defer_ledger("waited", started_at=130.0)  # an older figure: kept at 160
    store.open_ledger(pod="ran", started_at=100.0, **kw)
    store.close_ledger("ran", ended_at=200.0)
    store.defer_ledger("ran", started_at=150.0)  # closed: its bill stands
    assert [(e.pod, e.started_at, e.ended_at) for e in store.ledger("r1")] == [
        ("waited", 160.0, None),
        ("ran", 100.0, 200.0),
    ]


def test_an_eval_is_opened_once_recorded_once_and_failed_until_given_up(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    assert store.eval_progress("r1") == EvalProgress(-1, [], None, None)
    store.open_eval("r1", 0, launched_at=1.0)
    store.open_eval("r1", 0, launched_at=2.0)  # a relaunch (or a second scheduler): the eval stays as opened
    store.open_eval("r1", 2, launched_at=3.0)
    progress = store.eval_progress("r1")
    assert progress.launched_through == 2 and [(e.policy_version, e.launched_at) for e in progress.open] == [
        (0, 1.0),
        (2, 3.0),
    ]

    def result(version: int, mean: float) -> EvalResult:
        return EvalResult(
            policy_version=version,
            mean_score=mean,
            metrics={"mean": mean, "pass@2": 0.5},
            prompts=2,
            samples=4,
            seconds=1.5,
            ended_at=10.0,
        )

    store.record_eval("r1", result(0, 0.25))
    store.record_eval("r1", result(0, 0.9))  # recorded once: a second scheduler's record changes nothing
    store.fail_eval("r1", 2, failures=1, retry_at=20.0)
    progress = store.eval_progress("r1")
    assert [(e.policy_version, e.failures, e.retry_at) for e in progress.open] == [(2, 1, 20.0)]
    assert (progress.best.policy_version, progress.best.mean_score, progress.given_up) == (0, 0.25, None)

    store.fail_eval(
        "r1", 2, failures=3, retry_at=0.0, gave_up="x" * 600
    )  # PostgreSQL refuses a longer error than its column
    progress = store.eval_progress("r1")
    assert progress.open == [] and progress.launched_through == 2
    assert (progress.given_up.policy_version, progress.given_up.error) == (2, "x" * 500)
    store.record_eval("r1", result(4, 0.5))  # a result without an opened eval (its row lost) is recorded all the same
    assert store.eval_progress("r1").best.policy_version == 4
    assert [(e.policy_version, e.mean_score, e.metrics, e.prompts, e.seconds) for e in store.evals("r1")] == [
        (0, 0.25, {"mean": 0.25, "pass@2": 0.5}, 2, 1.5),
        (4, 0.5, {"mean": 0.5, "pass@2": 0.5}, 2, 1.5),
    ]
    # The run's view holds its latest recorded evals, read in the run's transaction.
    assert [e.policy_version for e in store.run_view("r1", latest=1).evals] == [4]
    assert [e.policy_version for e in store.run_view("r1", latest=10).evals] == [0, 4]


def test_pod_memory_reports_are_read_back_in_order_within_a_window(store: StateStore) -> None:
    store.create_run("r1", name=None, spec={})
    store.create_run("r2", name=None, spec={})
    store.report_memory("r1", "r1-rollout-0", "rollout", at=10.0, current=1e9, peak=1.5e9)
    store.report_memory("r2", "r2-rollout-0", "rollout", at=11.0, current=3e9, peak=3e9)
    store.report_memory("r1", "r1-train-1", "training", at=12.0, current=2e9, peak=2e9)
    rows = store.pod_memory("r1")
    assert [(r.pod, r.role, r.at, r.bytes, r.peak_bytes) for r in rows] == [
        ("r1-rollout-0", "rollout", 10.0, 1e9, 1.5e9),
        ("r1-train-1", "training", 12.0, 2e9, 2e9),
    ]
    assert [r.pod for r in store.pod_memory("r1", since=10.0)] == ["r1-train-1"]
    assert [r.pod for r in store.pod_memory("r1", until=11.9)] == ["r1-rollout-0"]
