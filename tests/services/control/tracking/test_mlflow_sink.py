"""The MLflow sink against a real MLflow tracking server (tests/servers/mlflow.py), read back through
its REST API: runs, metric histories, and what a restarted sink does not log twice."""

from __future__ import annotations

import uuid

import pytest

from services.control.tracking.mlflow_sink import MlflowServer, MlflowSink, metric_key, shown_url
from services.control.tracking.points import Point
from services.control.tracking.sink import TrackingError
from tests.servers.mlflow import MlflowTestServer
from tests.servers.process import free_port


def points(steps: range, shift: float = 0.0) -> list[Point]:
    return [Point(i, 1000.0 + i + shift, {"actor/pg_loss": 0.5 / i, "reward/mean": 0.25 * i + shift}) for i in steps]


def test_points_become_metric_histories_of_a_run_named_by_the_spotrl_run(mlflow_server: MlflowTestServer) -> None:
    experiment = f"exp-{uuid.uuid4().hex[:8]}"  # created by the sink
    server = MlflowServer(mlflow_server.url)
    sink = MlflowSink(server, experiment)
    sink.write("run-a", [*points(range(1, 3)), Point(1, 1500.5, {"eval/pass@4": 0.5, "eval/mean_score": 0.25})])
    sink.write("run-a", points(range(3, 4)))
    run = mlflow_server.run_of(experiment, "run-a")
    assert run["info"]["run_name"] == "run-a" and run["info"]["status"] == "RUNNING"
    mlflow_id = run["info"]["run_id"]
    assert mlflow_server.history(mlflow_id, "actor/pg_loss") == [(i, 0.5 / i, 1000_000 + 1000 * i) for i in (1, 2, 3)]
    assert mlflow_server.history(mlflow_id, "eval/pass_at_4") == [(1, 0.5, 1500_500)]  # '@' is not a valid MLflow name
    sink.end_run("run-a", "FAILED", 2000.0)
    info = mlflow_server.run_of(experiment, "run-a")["info"]
    assert (info["status"], info["end_time"]) == ("FAILED", 2000_000)
    server.close()


def test_a_restarted_sink_repeats_no_value(mlflow_server: MlflowTestServer) -> None:
    """MLflow keeps two values logged at one step (only an exact repeat of value and time is
    dropped): a new process reads each metric's last step first, so a batch sent again after a
    crash, its figures computed anew, and newer points with it log only what is new."""
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    first = MlflowServer(mlflow_server.url)
    MlflowSink(first, experiment).write("run-b", points(range(1, 4)))
    first.close()  # the scheduler dies before advancing its cursor
    again = MlflowServer(mlflow_server.url)
    MlflowSink(again, experiment).write(
        "run-b", [*points(range(1, 6), shift=0.5), Point(2, 1900.0, {"eval/mean_score": 0.5})]
    )
    mlflow_id = mlflow_server.run_of(experiment, "run-b")["info"]["run_id"]  # one run: found again by its tag
    assert [(s, v) for s, v, _ in mlflow_server.history(mlflow_id, "reward/mean")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
        (4, 1.5),
        (5, 1.75),
    ]
    assert [s for s, _, _ in mlflow_server.history(mlflow_id, "eval/mean_score")] == [2]
    again.close()


def test_metric_keys_keep_what_mlflow_accepts() -> None:
    assert metric_key("actor/pg_clipfrac") == "actor/pg_clipfrac"
    assert metric_key("eval/pass@16") == "eval/pass_at_16"
    assert metric_key("perf/tokens_per_s (p50)") == "perf/tokens_per_s _p50_"


def test_errors_name_the_server_never_its_credentials(mlflow_server: MlflowTestServer) -> None:
    token = "tok-" + uuid.uuid4().hex
    dead = MlflowServer(f"http://alice:pw-{token}@127.0.0.1:{free_port()}/mlflow?key={token}", token=token, timeout_s=5)
    with pytest.raises(TrackingError) as refused:
        MlflowSink(dead, "exp").write("run-c", points(range(1, 2)))
    message = str(refused.value)
    assert "MLflow at http://127.0.0.1:" in message and "ConnectError" in message
    assert token not in message and "alice" not in message and "pw-" not in message
    # A server that answers with an error: its code and message, still no credential.
    wrong_path = MlflowServer(f"{mlflow_server.url}/not-mlflow", token=token)
    with pytest.raises(TrackingError) as answered:
        MlflowSink(wrong_path, "exp").write("run-c", points(range(1, 2)))
    assert "answered 404" in str(answered.value) and token not in str(answered.value)
    assert shown_url("https://u:p@mlflow.example:5000/x?token=t#f") == "https://mlflow.example:5000/x"
    with pytest.raises(TrackingError, match="must be http"):
        MlflowServer(f"ftp://u:{token}@host/")
    for server in (dead, wrong_path):
        server.close()


def test_a_deleted_experiment_is_named_in_the_error(mlflow_server: MlflowTestServer) -> None:
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    created = mlflow_server.client.post("/experiments/create", json={"name": experiment}).raise_for_status().json()
    mlflow_server.client.post(
        "/experiments/delete", json={"experiment_id": created["experiment_id"]}
    ).raise_for_status()
    server = MlflowServer(mlflow_server.url)
    with pytest.raises(TrackingError, match=f"experiment '{experiment}' is deleted"):
        MlflowSink(server, experiment).write("run-d", points(range(1, 2)))
    server.close()


def test_credentials_in_the_uri_log_in_to_an_mlflow_server_with_auth(mlflow_auth_server: MlflowTestServer) -> None:
    """MLflow's basic-auth app: the URI's user and password reach it as basic auth; a wrong password
    is a 401 whose message holds neither."""
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    password = mlflow_auth_server.password
    host = mlflow_auth_server.url.removeprefix("http://")
    server = MlflowServer(f"http://admin:{password}@{host}")
    MlflowSink(server, experiment).write("run-e", points(range(1, 3)))
    mlflow_id = mlflow_auth_server.run_of(experiment, "run-e")["info"]["run_id"]
    assert [s for s, _, _ in mlflow_auth_server.history(mlflow_id, "reward/mean")] == [1, 2]
    server.close()
    wrong = MlflowServer(f"http://admin:not-{password}@{host}")
    with pytest.raises(TrackingError, match="answered 401") as refused:
        MlflowSink(wrong, experiment).write("run-e", points(range(3, 4)))
    assert password not in str(refused.value) and "admin" not in str(refused.value)
    wrong.close()
