"""A real MLflow tracking server for the MLflow sink's tests, started on a free loopback port.

The server comes from the full ``mlflow`` package in a venv of its own (``.venv/mlflow``, made by
``make test``; or ``$SPOTRL_MLFLOW``, the path of an ``mlflow`` executable): its pins stay out of
spotrl's environment, which talks to it over HTTP only. Its backend store is SQLite in a
temporary folder; it starts in 10-20 s on these machines, so one serves the whole session.

Fixtures:
- ``mlflow_server``: one server for the session (an ``MlflowTestServer``: ``url``, ``client``, a
  plain httpx client on its REST API for the tests' own reads).
- ``mlflow_auth_server``: one with MLflow's basic-auth app (``mlflow[auth]``), its admin user
  ``admin`` with a random password (``password``); its ``client`` logs in as that user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers.process import free_port, wait_until_it_answers

ROOT = Path(__file__).resolve().parents[2]


def mlflow_command() -> str:
    for candidate in (os.environ.get("SPOTRL_MLFLOW"), str(ROOT / ".venv" / "mlflow" / "bin" / "mlflow")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("the mlflow server is not installed: `make test` creates .venv/mlflow (or set SPOTRL_MLFLOW)")


class MlflowTestServer:
    """``mlflow server`` on 127.0.0.1 with a SQLite store in a temporary folder, stopped by its PID."""

    def __init__(self, password: str | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="spotrl-mlflow-"))
        self.log = self._dir / "mlflow.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = password
        auth_app, env = [], dict(os.environ)
        if password is not None:  # the admin user is created with this password on the first start
            auth_app = ["--app-name", "basic-auth"]
            env |= {
                "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": os.urandom(16).hex(),
                "MLFLOW_AUTH_CONFIG_PATH": str(self._auth_config()),
            }
        self._proc = subprocess.Popen(
            [
                mlflow_command(),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                *auth_app,
                "--backend-store-uri",
                f"sqlite:///{self._dir / 'mlflow.db'}",
                "--default-artifact-root",
                str(self._dir / "artifacts"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self._dir,
            start_new_session=True,  # its own process group: the server and the workers it starts end together
        )
        auth = ("admin", password) if password is not None else None
        self.client = httpx.Client(base_url=f"{self.url}/api/2.0/mlflow", auth=auth, timeout=30)
        wait_until_it_answers(
            self._proc,
            "mlflow server",
            lambda: httpx.get(f"{self.url}/health").status_code == 200,
            self.log,
            timeout_s=180.0,
            every_s=0.2,
        )

    def _auth_config(self) -> Path:
        """The auth app's settings, its user store in the temporary folder (the default is a file in the working directory)."""
        config = self._dir / "basic_auth.ini"
        config.write_text(
            f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{self._dir / 'auth.db'}\n"
            "admin_username = admin\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            # a password checked once a minute, not per request (PBKDF2 takes seconds on a busy machine)
            "auth_cache_ttl_seconds = 60\n"
        )
        return config

    def run_of(self, experiment: str, run_id: str) -> dict:
        """The MLflow run tagged with spotrl's ``run_id`` in ``experiment`` (its ``info`` and ``data``)."""
        found = (
            self.client.get("/experiments/get-by-name", params={"experiment_name": experiment})
            .raise_for_status()
            .json()
        )
        search = {
            "experiment_ids": [found["experiment"]["experiment_id"]],
            "filter": f"tags.`spotrl.run_id` = '{run_id}'",
        }
        (run,) = self.client.post("/runs/search", json=search).raise_for_status().json()["runs"]
        return run

    def history(self, mlflow_run_id: str, key: str) -> list[tuple[int, float, int]]:
        """Every value logged for ``key``: (step, value, timestamp in ms), in step order."""
        r = self.client.get(
            "/metrics/get-history", params={"run_id": mlflow_run_id, "metric_key": key}
        ).raise_for_status()
        return sorted((m["step"], m["value"], m["timestamp"]) for m in r.json().get("metrics", []))

    def stop(self) -> None:
        """Kill the server's process group: a test server keeps nothing, and ``mlflow server``
        takes its time over SIGTERM."""
        self.client.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server() -> Iterator[MlflowTestServer]:
    server = MlflowTestServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_auth_server() -> Iterator[MlflowTestServer]:
    server = MlflowTestServer(password="password-" + os.urandom(6).hex())
    yield server
    server.stop()
