"""The sync from the state store to all three trackers at once: TensorBoard files in a local object
store, a real MLflow server, W&B offline runs; each read back with its own reader. A restarted
scheduler (a fresh store handle, fresh sinks) neither loses nor repeats a point."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from services.control.tracking.points import dollars_at, eval_point, iteration_point
from services.control.tracking.sink import TrackingError
from services.control.tracking.sinks import SinkSet, missing_settings
from services.control.tracking.sync import Tracker, sync_run
from services.control.tracking.tensorboard_sink import TensorBoardSink, tensorboard_prefix
from services.control.tracking.wandb_sink import EVAL_STEP, history_rows, offline_logs
from services.core.config import Settings
from services.domain.runspec import Tracking
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import StateStore
from tests.servers.mlflow import MlflowTestServer
from tests.servers.process import free_port
from tests.services.control.tracking.test_tensorboard_sink import logged_steps, scalars
from tests.services.control.tracking.tracking_support import T0, end_run, make_run, record

EVALS = [
    eval_point(0, T0 + 50, {"mean_score": 0.1, "pass@4": 0.25}),
    eval_point(2, T0 + 250, {"mean_score": 0.3, "pass@4": 0.5}),
]


def open_tracker(store_url: str, settings: Settings, catalog: PriceCatalog) -> tuple[StateStore, SinkSet, Tracker]:
    """What a scheduler process holds: its own store handle and sinks."""
    store = StateStore(store_url)
    sinks = SinkSet(settings, LocalObjectStore(settings.home / "objects"))
    return store, sinks, Tracker(state=store, sinks=sinks, catalog=catalog, evals=lambda run_id: EVALS)


def test_a_restarted_scheduler_neither_loses_nor_repeats_a_point(
    tmp_path: Path, mlflow_server: MlflowTestServer, catalog: PriceCatalog
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    settings = Settings(home=tmp_path / "home", mlflow_tracking_uri=mlflow_server.url, wandb_mode="offline")
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    tracking = {"tensorboard": True, "mlflow": {"experiment": experiment}, "wandb": {"project": "spotrl-test"}}
    store, sinks, tracker = open_tracker(url, settings, catalog)
    make_run(store, "run-r", tracking=tracking, iterations=3)
    tracker.sync(store.list_runs(active_only=True))
    assert {n: (c.iteration, c.eval_version) for n, c in store.tracking_cursors("run-r").items()} == {
        "tensorboard": (3, 2),
        "mlflow": (3, 2),
        "wandb": (3, 2),
    }
    # Iterations 4 and 5 come; the scheduler writes them to every tracker and dies before advancing a cursor.
    record(store, "run-r", 4)
    record(store, "run-r", 5)
    entries = store.ledger("run-r")
    batch = [iteration_point(r, dollars_at(entries, catalog, r.ended_at)) for r in store.iterations("run-r", after=3)]
    for sink in sinks.for_run(Tracking.model_validate(tracking)):
        sink.write("run-r", batch)
    tracker.close()
    store.close()
    # A new scheduler: iteration 6 recorded meanwhile; then the run succeeds.
    store, _, tracker = open_tracker(url, settings, catalog)
    record(store, "run-r", 6)
    tracker.sync(store.list_runs(active_only=True))
    end_run(store, "run-r")
    tracker.sync(store.list_runs(active_only=True))  # none active: the ended run comes from its cursors
    assert store.runs_with_tracking_to_end(10) == []
    assert all(c.ended and c.iteration == 6 for c in store.tracking_cursors("run-r").values())
    tracker.close()
    store.close()

    # TensorBoard: every step once, the cost so far rising.
    tb = scalars(settings.home / "objects" / tensorboard_prefix("run-r"))
    assert [s for s, _, _ in tb["actor/pg_loss"]] == [1, 2, 3, 4, 5, 6]
    assert logged_steps(settings.home / "objects" / tensorboard_prefix("run-r"), "actor/pg_loss") == [1, 2, 3, 4, 5, 6]
    cost = [v for _, v, _ in tb["cost/dollars_so_far"]]
    assert cost == sorted(cost) and cost[0] > 0
    assert [s for s, _, _ in tb["eval/pass@4"]] == [0, 2]
    # MLflow: one run, every step once, ended FINISHED.
    run = mlflow_server.run_of(experiment, "run-r")
    assert run["info"]["status"] == "FINISHED"
    assert [s for s, _, _ in mlflow_server.history(run["info"]["run_id"], "response_length/mean")] == [1, 2, 3, 4, 5, 6]
    assert [(s, v) for s, v, _ in mlflow_server.history(run["info"]["run_id"], "eval/pass_at_4")] == [
        (0, 0.25),
        (2, 0.5),
    ]
    # W&B: over the offline folders of both processes, every step once.
    rows = [row for log in offline_logs(settings.resolved_wandb_dir(), "run-r") for row in history_rows(log)]
    assert [r["_step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r[EVAL_STEP] for r in rows if EVAL_STEP in r] == [0, 2]


def test_a_failing_tracker_holds_back_its_own_cursor_only(
    tmp_path: Path,
    store: StateStore,
    catalog: PriceCatalog,
    mlflow_server: MlflowTestServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    token = "tok-" + uuid.uuid4().hex
    down = Settings(
        home=tmp_path / "home", mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}", mlflow_tracking_token=token
    )
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    make_run(store, "run-f", tracking={"tensorboard": True, "mlflow": {"experiment": experiment}}, iterations=2)
    tracker = Tracker(state=store, sinks=SinkSet(down, LocalObjectStore(tmp_path / "objects")), catalog=catalog)
    with caplog.at_level(logging.WARNING, logger="services.control.tracking.sync"):
        tracker.sync(store.list_runs())  # logged, not raised: the scheduler's tick goes on
    assert "run run-f" in caplog.text and "MLflow at http://127.0.0.1:" in caplog.text and token not in caplog.text
    cursors = store.tracking_cursors("run-f")
    assert cursors["tensorboard"].iteration == 2 and "mlflow" not in cursors
    tracker.close()
    # The server is back (here: the operator points at the live one); the next sync catches up.
    up = Settings(home=tmp_path / "home", mlflow_tracking_uri=mlflow_server.url, mlflow_tracking_token=token)
    sinks = SinkSet(up, LocalObjectStore(tmp_path / "objects"))
    record(store, "run-f", 3)
    sync_run(
        store.get_run("run-f"),
        state=store,
        sinks=sinks.for_run(Tracking.model_validate({"tensorboard": True, "mlflow": {"experiment": experiment}})),
        catalog=catalog,
    )
    mlflow_id = mlflow_server.run_of(experiment, "run-f")["info"]["run_id"]
    assert [s for s, _, _ in mlflow_server.history(mlflow_id, "reward/mean")] == [1, 2, 3]
    assert [s for s, _, _ in scalars(tmp_path / "objects" / tensorboard_prefix("run-f"))["reward/mean"]] == [1, 2, 3]
    sinks.close()


def test_a_run_far_behind_catches_up_in_bounded_batches(
    tmp_path: Path, store: StateStore, catalog: PriceCatalog
) -> None:
    objects = LocalObjectStore(tmp_path / "objects")
    make_run(store, "run-b", tracking={"tensorboard": True}, iterations=5)
    sinks = [TensorBoardSink(objects)]
    evals = [eval_point(1, T0 + 150, {"mean_score": 0.2}), eval_point(4, T0 + 450, {"mean_score": 0.5})]
    sync_run(store.get_run("run-b"), state=store, sinks=sinks, catalog=catalog, evals=evals, limit=2)
    c = store.tracking_cursors("run-b")["tensorboard"]
    assert (c.iteration, c.eval_version) == (2, 1)  # the eval of v4 waits for iterations 3 and 4
    for _ in range(3):
        sync_run(store.get_run("run-b"), state=store, sinks=sinks, catalog=catalog, evals=evals, limit=2)
    c = store.tracking_cursors("run-b")["tensorboard"]
    assert (c.iteration, c.eval_version) == (5, 4)
    tb = scalars(objects.root / tensorboard_prefix("run-b"))
    assert [s for s, _, _ in tb["reward/mean"]] == [1, 2, 3, 4, 5]
    assert [s for s, _, _ in tb["eval/mean_score"]] == [1, 4]


def test_trackers_the_operator_has_not_configured_are_named(
    tmp_path: Path, store: StateStore, catalog: PriceCatalog, caplog: pytest.LogCaptureFixture
) -> None:
    bare = Settings(home=tmp_path / "home")
    tracking = Tracking.model_validate({"mlflow": {"experiment": "e"}, "wandb": {"project": "p"}})
    assert missing_settings(tracking, bare) == [
        "tracking.mlflow needs the operator's MLflow server (SPOTRL_MLFLOW_TRACKING_URI)",
        "tracking.wandb needs the operator's W&B API key (SPOTRL_WANDB_API_KEY or SPOTRL_WANDB_API_KEY_FILE)",
    ]
    key_file = tmp_path / "wandb-key"
    key_file.write_text("k" * 40 + "\n")
    assert (
        missing_settings(
            tracking, Settings(home=tmp_path, mlflow_tracking_uri="http://h:5000", wandb_api_key_file=key_file)
        )
        == []
    )
    with pytest.raises(TrackingError, match="SPOTRL_MLFLOW_TRACKING_URI"):
        SinkSet(bare, LocalObjectStore(tmp_path / "objects")).for_run(tracking)
    make_run(store, "run-m", tracking={"mlflow": {"experiment": "e"}}, iterations=1)
    tracker = Tracker(state=store, sinks=SinkSet(bare, LocalObjectStore(tmp_path / "objects")), catalog=catalog)
    with caplog.at_level(logging.WARNING, logger="services.control.tracking.sync"):
        tracker.sync(store.list_runs())
    assert "SPOTRL_MLFLOW_TRACKING_URI" in caplog.text
    assert store.tracking_cursors("run-m") == {}


def test_runs_without_tracking_are_left_alone(tmp_path: Path, store: StateStore, catalog: PriceCatalog) -> None:
    make_run(store, "run-n", iterations=2)
    tracker = Tracker(
        state=store, sinks=SinkSet(Settings(home=tmp_path), LocalObjectStore(tmp_path / "objects")), catalog=catalog
    )
    tracker.sync(store.list_runs())
    assert store.tracking_cursors("run-n") == {} and not (tmp_path / "objects" / "runs").exists()


def test_the_pods_memory_reaches_each_iteration_as_the_peak_of_each_role_since_the_one_before(
    tmp_path: Path, store: StateStore, catalog: PriceCatalog
) -> None:
    objects = LocalObjectStore(tmp_path / "objects")
    make_run(store, "run-m", tracking={"tensorboard": True}, iterations=3)  # iterations end at T0 + 100 i
    for at, pod, role, used in [
        (T0 + 30, "w0", "rollout", 1e9),
        (T0 + 60, "w0", "rollout", 1.5e9),
        (T0 + 90, "t1", "training", 4e9),
        (T0 + 130, "w0", "rollout", 1.2e9),
        (T0 + 260, "w1", "rollout", 2e9),
        (T0 + 290, "t3", "training", 5e9),
    ]:
        store.report_memory("run-m", pod, role, at=at, current=used, peak=used)
    for _ in range(2):  # batches of 2: the second batch's first iteration reads from the end of the first's last
        sync_run(store.get_run("run-m"), state=store, sinks=[TensorBoardSink(objects)], catalog=catalog, limit=2)
    tb = scalars(objects.root / tensorboard_prefix("run-m"))
    assert [(s, v) for s, v, _ in tb["memory/rollout/max_bytes"]] == [(1, 1.5e9), (2, 1.2e9), (3, 2e9)]
    assert [(s, v) for s, v, _ in tb["memory/training/max_bytes"]] == [(1, 4e9), (3, 5e9)]
