"""`spotrl runs ...` against real `spotrl serve` processes with tokens, as from a laptop.

Two servers, each on a free loopback port with a tokens file: `busy` runs the scheduler and
trains one tiny run for real (its pods' logs, the live table, the bill), `idle` serves the API
alone (--no-scheduler), so the runs the other tests submit stay PENDING and cost no CPU. The CLI
runs in this process (typer's runner, the real `spotrl` app), and as its own process where it
matters: following logs, and the check that the client imports no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from contracts.status import RunStatus
from services.cli.main import app as spotrl
from services.control.api.auth import add_token
from services.control.scheduler.lease import SCHEDULER_LEASE
from services.core.config import Settings
from services.ports.state.state_store import StateStore
from tests.servers.process import free_port
from tests.test_end_to_end import stop_serving, wait_until_ready

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]


@dataclass
class Server:
    url: str
    home: Path
    tokens: dict[str, str]
    http: httpx.Client
    pid: int  # of its `spotrl serve` process


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("tokens") / "tokens.json"
    return path, {"acme": add_token(path, tenant="acme"), "globex": add_token(path, tenant="globex")}


def _serve(root: Path, tokens_file: tuple[Path, dict[str, str]], *extra: str) -> tuple[subprocess.Popen, Server]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),  # the serve process and its pods run this checkout's code
        "SPOTRL_HOME": str(root / "home"),
        "SPOTRL_MODEL_CACHE": str(root.parent / "models"),
        "SPOTRL_TOKENS_FILE": str(tokens_file[0]),
        "SPOTRL_TICK_SECONDS": "0.2",
        "SPOTRL_STOP_GRACE_S": "10",
        "SPOTRL_POD_THREADS": "1",
    }
    with open(root / "serve.log", "wb") as log:  # the process writes to its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "serve", "--port", str(port), *extra],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    return proc, Server(url, root / "home", tokens_file[1], httpx.Client(base_url=url, timeout=30), proc.pid)


def _stop(proc: subprocess.Popen, server: Server) -> None:
    stop_serving(proc, server.home)
    server.http.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tokens_file) -> Iterator[dict[str, Server]]:
    """Both servers, started side by side (each takes a second or two to import)."""
    busy_root, idle_root = tmp_path_factory.mktemp("busy"), tmp_path_factory.mktemp("idle")
    busy_proc, busy = _serve(busy_root, tokens_file)
    idle_proc, idle = _serve(idle_root, tokens_file, "--no-scheduler")
    try:
        wait_until_ready(busy_proc, busy.http, busy_root / "serve.log")
        wait_until_ready(idle_proc, idle.http, idle_root / "serve.log")
        yield {"busy": busy, "idle": idle}
    finally:
        _stop(busy_proc, busy)
        _stop(idle_proc, idle)


def _lease_holder(home: Path) -> str | None:
    state = StateStore(Settings(home=home).resolved_state_url())
    try:
        return state.lease_holder(SCHEDULER_LEASE)
    finally:
        state.close()


def test_serve_runs_the_scheduler_unless_told_not_to(servers, wait_for) -> None:
    """`spotrl serve` leads its home's scheduler lease itself (the embedded loop, by default); with
    --no-scheduler it leaves the lease to `spotrl scheduler` processes, and none holds it there
    (the idle server was ready, so its first tick would have taken it)."""
    busy, idle = servers["busy"], servers["idle"]
    holder = wait_for(lambda: _lease_holder(busy.home), message="the busy server's scheduler took the lease")
    assert holder.split(":")[1] == str(busy.pid), holder  # host:pid:instance (services.control.scheduler.lease)
    assert _lease_holder(idle.home) is None


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config") / "config.yaml"  # absent unless a test writes it


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@pytest.fixture
def cli(config_file: Path):
    """`cli(*args, server=..., token=..., env=...)`: the `spotrl` command in this process.
    Server and token go in the environment (SPOTRL_SERVER, SPOTRL_TOKEN) unless None."""

    def run(
        *args: str, server: Server | str | None = None, token: str | None = None, env: dict | None = None
    ) -> Result:
        environ = {"SPOTRL_CONFIG": str(config_file), "SPOTRL_SERVER": None, "SPOTRL_TOKEN": None, "COLUMNS": "200"}
        if server is not None:
            environ["SPOTRL_SERVER"] = server if isinstance(server, str) else server.url
        if token is not None:
            environ["SPOTRL_TOKEN"] = token
        environ.update(env or {})
        r = CliRunner().invoke(spotrl, list(args), env=environ, catch_exceptions=False)
        return Result(r.exit_code, r.stdout, r.stderr)

    return run


def tiny_spec(**changes) -> dict:
    spec = {
        "model": "tiny",
        "prompts": PROMPTS,
        "samples_per_prompt": 4,
        "sampling": {"max_new_tokens": 8},
        "batch_samples": 16,
        "iterations": 1,
        "rollout": {"min_workers": 1, "max_workers": 1, "prompts_per_batch": 4},
        "training": {"learning_rate": 1e-3, "micro_batch": 8},
    }
    spec.update(changes)
    return spec


@pytest.fixture(scope="module")
def tiny_run(servers, tmp_path_factory: pytest.TempPathFactory, config_file: Path) -> dict:
    """The one run that trains: submitted first, from YAML naming a JSONL file next to it, so
    that it runs while the other tests use the idle server."""
    folder = tmp_path_factory.mktemp("spec")
    (folder / "arithmetic.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (folder / "run.yaml").write_text(yaml.safe_dump(tiny_spec(name="remote-tiny", prompts="arithmetic.jsonl")))
    busy = servers["busy"]
    r = CliRunner().invoke(
        spotrl,
        ["runs", "submit", str(folder / "run.yaml"), "-o", "json"],
        env={"SPOTRL_SERVER": busy.url, "SPOTRL_TOKEN": busy.tokens["acme"], "SPOTRL_CONFIG": str(config_file)},
    )
    assert r.exit_code == 0, r.output
    return r.stdout and json.loads(r.stdout)


def api_run(server: Server, token: str, run_id: str) -> dict:
    return server.http.get(f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {token}"}).json()


# --- submit -------------------------------------------------------------------------------------


def test_submit_yaml_uploads_the_local_prompts_first(tiny_run, servers, cli) -> None:
    busy = servers["busy"]
    assert tiny_run["name"] == "remote-tiny" and tiny_run["tenant"] == "acme"
    assert tiny_run["spec"]["prompts"].startswith("store://datasets/")  # uploaded, then named
    assert tiny_run["prompt_count"] == len(PROMPTS)
    got = cli("runs", "get", tiny_run["id"], "-o", "json", server=busy, token=busy.tokens["acme"])
    assert got.code == 0 and got.json()["id"] == tiny_run["id"]


def test_submit_json_then_get(servers, cli, tmp_path: Path) -> None:
    idle = servers["idle"]
    spec = tmp_path / "run.json"
    spec.write_text(json.dumps(tiny_spec(name="from-json", iterations=3)))
    submitted = cli("runs", "submit", str(spec), server=idle, token=idle.tokens["acme"])
    assert submitted.code == 0, submitted.stderr
    run_id = submitted.stdout.split()[1]
    assert submitted.stdout.startswith(f"submitted {run_id} (PENDING)")

    as_json = cli("runs", "get", run_id, "-o", "json", server=idle, token=idle.tokens["acme"]).json()
    assert (as_json["name"], as_json["status"], as_json["spec"]["iterations"], as_json["prompt_count"]) == (
        "from-json",
        "PENDING",
        3,
        8,
    )
    table = cli("runs", "get", run_id, server=idle, token=idle.tokens["acme"])
    assert table.code == 0 and run_id in table.stdout and "PENDING" in table.stdout and "from-json" in table.stdout
    assert RunStatus.PENDING.meaning in table.stdout  # what the status means, under it


# --- list, cancel, cost --------------------------------------------------------------------------


def test_list_follows_every_page_and_shows_the_tenants_runs_only(servers, cli, tmp_path: Path) -> None:
    idle = servers["idle"]
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec()))
    mine = [
        cli("runs", "submit", str(spec), "-o", "json", server=idle, token=idle.tokens["globex"]).json()["id"]
        for _ in range(5)
    ]

    listed = cli("runs", "list", "--page-size", "2", "-o", "json", server=idle, token=idle.tokens["globex"])
    assert listed.code == 0, listed.stderr
    assert [r["id"] for r in listed.json()] == mine  # three pages, oldest first, nobody else's
    table = cli("runs", "list", "--page-size", "2", server=idle, token=idle.tokens["globex"])
    assert all(run_id in table.stdout for run_id in mine)
    theirs = cli("runs", "list", "-o", "json", server=idle, token=idle.tokens["acme"]).json()
    assert not set(mine) & {r["id"] for r in theirs}


def test_cancel_and_cost(servers, cli, tmp_path: Path) -> None:
    idle = servers["idle"]
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec()))
    run_id = cli("runs", "submit", str(spec), "-o", "json", server=idle, token=idle.tokens["acme"]).json()["id"]

    cost = cli("runs", "cost", run_id, "-o", "json", server=idle, token=idle.tokens["acme"])
    assert cost.code == 0 and cost.json()["total_dollars"] == 0 and cost.json()["run_id"] == run_id
    assert "spent in total" in cli("runs", "cost", run_id, server=idle, token=idle.tokens["acme"]).stdout

    cancelled = cli("runs", "cancel", run_id, server=idle, token=idle.tokens["acme"])
    assert cancelled.code == 0 and cancelled.stdout.startswith(f"{run_id} CANCELLING (cancelled before it started)")
    assert (
        cli("runs", "get", run_id, "-o", "json", server=idle, token=idle.tokens["acme"]).json()["status"]
        == "CANCELLING"
    )


# --- errors, as the API gave them ----------------------------------------------------------------


def test_a_wrong_token_is_the_apis_401(servers, cli) -> None:
    idle = servers["idle"]
    r = cli("runs", "list", server=idle, token="srl_wrong")
    assert r.code == 1 and r.stdout == ""
    assert r.stderr.startswith("error: 401 Unauthorized: send `Authorization: Bearer <token>`")
    r = cli("runs", "list", "-o", "json", server=idle)  # no token at all
    assert r.code == 1 and json.loads(r.stderr)["status"] == 401


def test_an_unknown_run_is_the_apis_404(servers, cli) -> None:
    idle = servers["idle"]
    for command in (["get"], ["cancel"], ["cost"], ["logs"], ["watch", "--once"]):
        r = cli("runs", *command, "run-0123456789", server=idle, token=idle.tokens["acme"])
        assert (r.code, r.stderr) == (1, "error: 404 Not Found: no such run\n"), command
    r = cli("runs", "get", "run-0123456789", "-o", "json", server=idle, token=idle.tokens["acme"])
    assert json.loads(r.stderr) == {"status": 404, "detail": "no such run"}


def test_an_invalid_spec_is_the_apis_422_field_by_field(servers, cli, tmp_path: Path) -> None:
    idle = servers["idle"]
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(batch_samples=15, rollout={"max_workers": 100_000})))
    r = cli("runs", "submit", str(spec), server=idle, token=idle.tokens["acme"])
    assert r.code == 1
    lines = r.stderr.splitlines()
    assert lines[0] == "error: 422 Unprocessable Entity"
    assert any(line.startswith("  body.rollout.max_workers: ") for line in lines[1:]), r.stderr
    detail = json.loads(cli("runs", "submit", str(spec), "-o", "json", server=idle, token=idle.tokens["acme"]).stderr)
    assert detail["status"] == 422 and {"loc", "msg", "type"} <= set(detail["detail"][0])

    (tmp_path / "list.yaml").write_text("- not a mapping\n")
    r = cli("runs", "submit", str(tmp_path / "list.yaml"), server=idle, token=idle.tokens["acme"])
    assert r.code == 2 and "must hold a mapping" in r.stderr  # refused here, before any request


def test_no_server_or_an_unreachable_one_says_so(cli) -> None:
    r = cli("runs", "list")
    assert r.code == 2 and "no API server: pass --server URL, set SPOTRL_SERVER" in r.stderr
    r = cli("runs", "list", server=f"http://127.0.0.1:{free_port()}")
    assert r.code == 1 and r.stderr.startswith("error: cannot reach the API at http://127.0.0.1:")


# --- where server and token come from -----------------------------------------------------------


def test_flags_then_environment_then_config_file(servers, cli, config_file: Path) -> None:
    idle = servers["idle"]
    nowhere = f"http://127.0.0.1:{free_port()}"
    try:
        login = cli("login", "--server", idle.url, "--token", idle.tokens["acme"])
        assert login.code == 0, login.stderr
        assert yaml.safe_load(config_file.read_text()) == {"server": idle.url, "token": idle.tokens["acme"]}
        assert config_file.stat().st_mode & 0o777 == 0o600  # it holds a token
        shown = cli("config", "show", "-o", "json").json()
        assert shown == {"path": str(config_file), "server": idle.url, "token": "set"}  # never the token

        assert cli("runs", "list").code == 0  # the file alone
        assert cli("runs", "list", server=nowhere).code == 1  # the environment over the file
        assert cli("runs", "list", "--server", idle.url, server=nowhere).code == 0  # a flag over both
        assert cli("runs", "list", token="srl_wrong").code == 1  # likewise the token
        assert cli("runs", "list", "--token", idle.tokens["acme"], token="srl_wrong").code == 0
        # The file's token is the file's server's: another server named in a flag gets none.
        other = cli("runs", "list", "--server", servers["busy"].url)
        assert other.code == 1 and other.stderr.startswith("error: 401 Unauthorized")

        assert cli("login", "--server", idle.url, "--token", "srl_wrong").code == 1  # checked before it is kept
        assert yaml.safe_load(config_file.read_text())["token"] == idle.tokens["acme"]
        assert cli("config", "set-server", nowhere).code == 0
        assert cli("runs", "list").stderr.startswith(f"error: cannot reach the API at {nowhere}")
    finally:
        config_file.unlink(missing_ok=True)


# --- the run that trains: logs, watch, cost -------------------------------------------------------


def test_logs_of_a_running_pod_and_watch_once(tiny_run, servers, cli, wait_for) -> None:
    busy, acme = servers["busy"], servers["busy"].tokens["acme"]
    auth = {"Authorization": f"Bearer {acme}"}

    def running_pod_with_a_log():
        for pod in busy.http.get(f"/v1/runs/{tiny_run['id']}/pods", headers=auth).json()["pods"]:
            log = busy.http.get(f"/v1/runs/{tiny_run['id']}/pods/{pod['name']}/logs", headers=auth).json()
            if log["running"] and log["lines"]:
                return pod["name"]
        return None

    pod = wait_for(running_pod_with_a_log, timeout_s=60, message="a pod of the run runs and has logged")
    r = cli("runs", "logs", tiny_run["id"], "--pod", pod, "--tail", "5", server=busy, token=acme)
    assert r.code == 0 and 1 <= len(r.stdout.splitlines()) <= 5
    as_json = cli("runs", "logs", tiny_run["id"], "--pod", pod, "-o", "json", server=busy, token=acme).json()
    assert as_json["pod"] == pod and as_json["lines"]

    watched = cli("runs", "watch", tiny_run["id"], "--once", server=busy, token=acme)
    assert watched.code == 0 and tiny_run["id"] in watched.stdout and "training iterations" in watched.stdout

    # Another tenant's run, and its pods, are as absent as a run that never was.
    other = cli("runs", "logs", tiny_run["id"], "--pod", pod, server=busy, token=busy.tokens["globex"])
    assert (other.code, other.stderr) == (1, "error: 404 Not Found: no such run\n")
    r = cli("runs", "logs", tiny_run["id"], "--pod", f"{tiny_run['id']}-train-999", server=busy, token=acme)
    assert (r.code, r.stderr) == (1, "error: 404 Not Found: no such pod of this run\n")


def test_logs_follow_prints_every_pod_until_the_run_ends(tiny_run, servers) -> None:
    """As its own process, the way a user runs it: it must end by itself when the run has."""
    busy = servers["busy"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRL_SERVER": busy.url, "SPOTRL_TOKEN": busy.tokens["acme"]}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "runs", "logs", tiny_run["id"], "--follow", "--interval", "0.5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    prefixes = {line.split(" | ", 1)[0] for line in out.stdout.splitlines() if " | " in line}
    assert f"{tiny_run['id']}-rollout-0" in prefixes and f"{tiny_run['id']}-train-1" in prefixes, prefixes
    assert api_run(busy, busy.tokens["acme"], tiny_run["id"])["status"] == "SUCCEEDED"


def test_after_the_run_logs_are_kept_and_watch_and_cost_show_the_end(tiny_run, servers, cli) -> None:
    busy, acme = servers["busy"], servers["busy"].tokens["acme"]
    logs = cli("runs", "logs", tiny_run["id"], "-o", "json", server=busy, token=acme).json()
    names = {p["pod"] for p in logs["pods"]}
    assert {f"{tiny_run['id']}-rollout-0", f"{tiny_run['id']}-train-1"} <= names
    assert all(not p["running"] and p["lines"] for p in logs["pods"])  # from the object store now
    table = cli("runs", "logs", tiny_run["id"], "--tail", "3", server=busy, token=acme)
    assert f"==> {tiny_run['id']}-train-1 (ended) <==" in table.stdout

    watched = cli("runs", "watch", tiny_run["id"], server=busy, token=acme)  # until it ends: it has
    assert watched.code == 0 and f"{tiny_run['id']} SUCCEEDED" in watched.stdout
    lines = cli("runs", "watch", tiny_run["id"], "-o", "json", server=busy, token=acme).stdout.splitlines()
    assert json.loads(lines[-1])["status"] == "SUCCEEDED" and len(json.loads(lines[-1])["iterations"]) == 1

    cost = cli("runs", "cost", tiny_run["id"], "-o", "json", server=busy, token=acme).json()
    assert cost["total_dollars"] > 0 and set(cost["by_role"]) == {"rollout", "training"}
    assert "spent in total" in cli("runs", "cost", tiny_run["id"], server=busy, token=acme).stdout

    r = cli("runs", "cancel", tiny_run["id"], server=busy, token=acme)
    assert r.code == 1 and r.stderr.startswith("error: 409 Conflict: run ") and "nothing to cancel" in r.stderr


def test_the_client_imports_no_torch(servers) -> None:
    """What a laptop runs: `spotrl runs list` in a fresh interpreter, and torch never imported."""
    idle = servers["idle"]
    code = (
        "import sys\n"
        "from services.cli.main import app\n"
        "try:\n"
        "    app(['runs', 'list', '-o', 'json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        # The run spec reads the price catalog (a file); no adapter and none of the servers' clients.
        "ports = {m for m in sys.modules if m.startswith('services.ports')}\n"
        "assert ports <= {'services.ports', 'services.ports.prices', 'services.ports.prices.catalog'}, ports\n"
        "clients = {'torch', 'sqlalchemy', 'kafka', 'boto3', 'redis', 'kubernetes'} & set(sys.modules)\n"
        "assert not clients, clients\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRL_SERVER": idle.url, "SPOTRL_TOKEN": idle.tokens["acme"]}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(out.stdout), list)
