"""MLflow: a run's points as metric histories of an MLflow run, through the tracking server's REST
API (``/api/2.0/mlflow/...``) over httpx.

httpx rather than the ``mlflow`` package: the control plane needs five endpoints
(experiments/get-by-name and create, runs/search and create, runs/get, runs/log-batch,
runs/update), and even ``mlflow-skinny`` brings its own pins of protobuf, packaging, cachetools
and more into the scheduler's environment, and a second HTTP stack.

Each spotrl run is one MLflow run in the run spec's experiment (created if missing), named by
the spotrl run id and tagged ``spotrl.run_id``, so a restarted scheduler finds it again. MLflow
keeps every value logged, even twice at one step, so before its first write for a run a sink
reads the latest step of each metric (``runs/get``: MLflow keeps each key's value at its highest
step) and skips what is not beyond it: a write repeated after a crash logs nothing twice.

Metric names: MLflow accepts letters, digits, ``_ - . : /`` and spaces; ``@`` becomes ``_at_``
(``eval/pass@4`` is ``eval/pass_at_4``) and any other character ``_``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import httpx

from services.control.tracking.points import Point
from services.control.tracking.sink import TrackingError

API = "/api/2.0/mlflow"
RUN_TAG = "spotrl.run_id"
# runs/log-batch takes at most 1000 metrics a request (MLflow's MAX_METRICS_PER_BATCH).
BATCH_METRICS = 1000
# spotrl's terminal statuses as MLflow's RunStatus.
MLFLOW_STATUS = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
_INVALID = re.compile(r"[^\w\-. :/]")


def metric_key(name: str) -> str:
    """``name`` as a valid MLflow metric key."""
    return _INVALID.sub("_", name.replace("@", "_at_"))


def shown_url(url: str) -> str:
    """The server's URL as messages show it: no user, password, query or fragment."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(username=None, password=None, query=None, fragment=None))


class MlflowServer:
    """One tracking server: the HTTP client, and what this process learnt of it (experiment ids,
    and per spotrl run its MLflow run id and each metric's last logged step)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise TrackingError(f"the MLflow tracking URI must be http(s)://host[:port][/path], not {shown_url(url)!r}")
        # Credentials in the URI (https://user:password@host) become basic auth: never part of a
        # URL that an error message or httpx's request log shows.
        auth = httpx.BasicAuth(parsed.username, parsed.password) if parsed.username else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = shown_url(url)
        self._client = httpx.Client(base_url=self.url.rstrip("/") + API, auth=auth, headers=headers, timeout=timeout_s)
        self._experiments: dict[str, str] = {}
        self.runs: dict[str, str] = {}  # spotrl run id -> MLflow run id
        self.logged: dict[str, dict[str, int]] = {}  # spotrl run id -> metric key -> last step

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """The endpoint's JSON answer; ``TrackingError`` naming the server and MLflow's error code."""
        try:
            r = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as e:  # the message is the OS's or httpx's: no URL, no header
            raise TrackingError(f"MLflow at {self.url}: {path} failed: {type(e).__name__}: {e}") from None
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code >= 400:
            code, message = str(body.get("error_code", "")), str(body.get("message", ""))[:300]
            raise MlflowError(self.url, path, r.status_code, code, message or r.reason_phrase)
        return body

    def experiment_id(self, name: str) -> str:
        """The id of the experiment ``name``, created if missing (by another process meanwhile too)."""
        if name not in self._experiments:
            try:
                found = self.call("GET", "/experiments/get-by-name", params={"experiment_name": name})["experiment"]
            except MlflowError as e:
                if e.code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                try:
                    self._experiments[name] = self.call("POST", "/experiments/create", json={"name": name})[
                        "experiment_id"
                    ]
                except MlflowError as again:
                    if again.code != "RESOURCE_ALREADY_EXISTS":
                        raise
                    return self.experiment_id(name)
            else:
                if found.get("lifecycle_stage") == "deleted":
                    raise TrackingError(
                        f"MLflow at {self.url}: experiment {name!r} is deleted: restore it, or name another"
                    ) from None
                self._experiments[name] = found["experiment_id"]
        return self._experiments[name]

    def run_id(self, experiment: str, run_id: str, start_ms: int) -> str:
        """The MLflow run of spotrl's ``run_id`` in ``experiment``: found by its tag, else created.
        On first use in this process, each metric's last step is read too."""
        if run_id in self.runs:
            return self.runs[run_id]
        experiment_id = self.experiment_id(experiment)
        found = self.call(
            "POST",
            "/runs/search",
            json={"experiment_ids": [experiment_id], "filter": f"tags.`{RUN_TAG}` = '{run_id}'", "max_results": 1},
        ).get("runs", [])
        if found:
            mlflow_id = found[0]["info"]["run_id"]
            metrics = (
                self.call("GET", "/runs/get", params={"run_id": mlflow_id})["run"].get("data", {}).get("metrics", [])
            )
            self.logged[run_id] = {m["key"]: int(m.get("step", 0)) for m in metrics}
        else:
            tags = [{"key": RUN_TAG, "value": run_id}, {"key": "mlflow.source.name", "value": "spotrl"}]
            created = self.call(
                "POST",
                "/runs/create",
                json={"experiment_id": experiment_id, "run_name": run_id, "start_time": start_ms, "tags": tags},
            )
            mlflow_id = created["run"]["info"]["run_id"]
            self.logged[run_id] = {}
        self.runs[run_id] = mlflow_id
        return mlflow_id

    def close(self) -> None:
        self._client.close()


class MlflowError(TrackingError):
    """The server answered with an error (``code``: MLflow's error code, e.g. RESOURCE_DOES_NOT_EXIST)."""

    def __init__(self, url: str, path: str, status: int, code: str, message: str) -> None:
        super().__init__(f"MLflow at {url}: {path} answered {status} {f'{code}: ' if code else ''}{message}")
        self.code = code


class MlflowSink:
    """The points of runs logged under one MLflow ``experiment`` of ``server``."""

    name = "mlflow"

    def __init__(self, server: MlflowServer, experiment: str) -> None:
        self._server = server
        self.experiment = experiment

    def write(self, run_id: str, points: Sequence[Point]) -> None:
        if not points:
            return
        start_ms = int(min(p.wall_time for p in points) * 1000)
        mlflow_id = self._server.run_id(self.experiment, run_id, start_ms)
        logged = self._server.logged[run_id]
        metrics = []
        for p in points:
            for name, value in p.values.items():
                key = metric_key(name)
                if p.step > logged.get(key, -1) and math.isfinite(value):
                    metrics.append({"key": key, "value": value, "timestamp": int(p.wall_time * 1000), "step": p.step})
        for i in range(0, len(metrics), BATCH_METRICS):
            chunk = metrics[i : i + BATCH_METRICS]
            self._server.call("POST", "/runs/log-batch", json={"run_id": mlflow_id, "metrics": chunk})
            for m in chunk:  # each key's steps ascend within a write: the last is the highest
                logged[m["key"]] = m["step"]

    def end_run(self, run_id: str, status: str, ended_at: float) -> None:
        mlflow_id = self._server.run_id(self.experiment, run_id, int(ended_at * 1000))
        body = {"run_id": mlflow_id, "status": MLFLOW_STATUS.get(status, "FINISHED"), "end_time": int(ended_at * 1000)}
        self._server.call("POST", "/runs/update", json=body)
        self._server.runs.pop(run_id, None)
        self._server.logged.pop(run_id, None)

    def close(self) -> None:
        """The server's client is the sink set's to close."""
