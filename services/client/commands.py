"""``spotrl runs ...``, ``spotrl config ...`` and ``spotrl login``: a remote API's runs from a laptop.

Every command takes ``--server`` and ``--token`` (else SPOTRL_SERVER / SPOTRL_TOKEN, else the
config file) and ``--output table|json``. An API error is shown as the API gave it, its status
and detail (on stderr; a JSON object with ``--output json``), and the command exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from services.client.api import ApiClient

runs_app = typer.Typer(
    no_args_is_help=True, help="Runs on a spotrl API server: submit, list, inspect, cancel, cost, logs, watch."
)
config_app = typer.Typer(
    no_args_is_help=True, help="The client's config file: the API server and token `spotrl runs` uses."
)

# Exit statuses: the API refused or could not be reached; the command cannot be run as given.
EXIT_API = 1
EXIT_USAGE = 2


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


ServerOption = Annotated[
    str | None, typer.Option("--server", envvar="SPOTRL_SERVER", help="API server URL (else the config file).")
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="SPOTRL_TOKEN", show_envvar=True, help="Bearer token (else the config file)."),
]
OutputOption = Annotated[Output, typer.Option("--output", "-o", help="table, for people, or json, for programs.")]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="The run's id (run-...).")]


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def _console() -> Any:
    from rich.console import Console

    return Console()


@contextmanager
def _api(server: str | None, token: str | None, output: Output) -> Iterator[ApiClient]:
    """The client of the chosen server; API and client errors become a message and an exit status."""
    from services.client.api import ApiClient, ApiError, ClientError, UnreachableError, resolve_target

    def fail(message: dict[str, Any] | list[str], code: int) -> typer.Exit:
        if output is Output.JSON:
            typer.echo(json.dumps(message), err=True)
        else:
            for line in message:
                typer.echo(f"error: {line}" if line is message[0] else line, err=True)
        return typer.Exit(code)

    try:
        with ApiClient(resolve_target(server, token)) as client:
            yield client
    except ApiError as e:
        raise fail(e.as_json() if output is Output.JSON else e.lines(), EXIT_API) from None
    except ClientError as e:
        code = EXIT_API if isinstance(e, UnreachableError) else EXIT_USAGE
        raise fail({"error": str(e)} if output is Output.JSON else [str(e)], code) from None


@runs_app.command("submit")
def submit(
    spec_file: Annotated[
        Path, typer.Argument(metavar="SPEC", help="Run spec, YAML or JSON: the body of POST /v1/runs.")
    ],
    server: ServerOption = None,
    token: TokenOption = None,
    output: OutputOption = Output.TABLE,
) -> None:
    """Submit a run. A `prompts` (or `eval.prompts`) naming a JSONL or Parquet file on this machine
    (relative to SPEC) is uploaded first (POST /v1/datasets, its rows mapped by the spec's
    `dataset`) and the run names the upload."""
    from services.client.api import read_spec_file, upload_local_prompts

    with _api(server, token, output) as client:
        spec = read_spec_file(spec_file)
        dataset = upload_local_prompts(client, spec, base_dir=spec_file.parent)
        run = client.submit(spec)
    if output is Output.JSON:
        _print_json(run)
        return
    if dataset is not None:
        typer.echo(f"uploaded {dataset['prompts']} prompts as {dataset['uri']}")
    typer.echo(f"submitted {run['id']} ({run['status']}); `spotrl runs watch {run['id']}` shows it live")


@runs_app.command("list")
def list_runs(
    page_size: Annotated[
        int, typer.Option("--page-size", min=1, max=200, help="Runs asked per request; every page is read.")
    ] = 50,
    server: ServerOption = None,
    token: TokenOption = None,
    output: OutputOption = Output.TABLE,
) -> None:
    """Every run this token sees (all tenants' for an admin), oldest first."""
    with _api(server, token, output) as client:
        runs = list(client.list_runs(page_size=page_size))
    if output is Output.JSON:
        _print_json(runs)
        return
    from services.client.view import runs_table

    _console().print(runs_table(runs))


@runs_app.command("get")
def get(
    run_id: RunArg, server: ServerOption = None, token: TokenOption = None, output: OutputOption = Output.TABLE
) -> None:
    """A run: where it stands, its iterations, its spec (with --output json)."""
    with _api(server, token, output) as client:
        run = client.get_run(run_id)
    if output is Output.JSON:
        _print_json(run)
        return
    from services.client.view import run_details

    _console().print(run_details(run))


@runs_app.command("cancel")
def cancel(
    run_id: RunArg, server: ServerOption = None, token: TokenOption = None, output: OutputOption = Output.TABLE
) -> None:
    """Cancel a run: its pods are stopped, then it reads CANCELLED."""
    with _api(server, token, output) as client:
        run = client.cancel_run(run_id)
    if output is Output.JSON:
        _print_json(run)
        return
    typer.echo(f"{run['id']} {run['status']}" + (f" ({run['status_reason']})" if run["status_reason"] else ""))


@runs_app.command("cost")
def cost(
    run_id: RunArg, server: ServerOption = None, token: TokenOption = None, output: OutputOption = Output.TABLE
) -> None:
    """A run's bill: by role and capacity type, against always-on on-demand and the lower bound."""
    with _api(server, token, output) as client:
        report = client.run_cost(run_id)
    if output is Output.JSON:
        _print_json(report)
        return
    from services.client.view import cost_table

    _console().print(cost_table(report))


@runs_app.command("watch")
def watch(
    run_id: RunArg,
    once: Annotated[bool, typer.Option("--once", help="Show the run as it stands now and exit.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between reads of the run.")] = 1.0,
    server: ServerOption = None,
    token: TokenOption = None,
    output: OutputOption = Output.TABLE,
) -> None:
    """The run live (the table `spotrl demo` shows) until it ends; Ctrl-C stops watching, not the run.

    With --output json, one line of the run's JSON each time it changes."""
    from services.client.view import run_progress, watch_run

    with _api(server, token, output) as client:
        run = client.get_run(run_id)
        if output is Output.JSON:
            _watch_json(lambda: client.get_run(run_id), run, once=once, interval_s=interval)
            return
        console = _console()
        if once:
            console.print(run_progress(run))
            return
        try:
            run = watch_run(lambda: client.get_run(run_id), run, console=console, interval_s=interval)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
    typer.echo(f"{run['id']} {run['status']}: {run['status_reason']}")


def _watch_json(fetch: Callable[[], dict[str, Any]], run: dict[str, Any], *, once: bool, interval_s: float) -> None:
    from contracts.status import RunStatus

    typer.echo(json.dumps(run))
    while not once and not RunStatus(run["status"]).is_terminal():
        time.sleep(interval_s)
        latest = fetch()
        if latest != run:
            typer.echo(json.dumps(latest))
            sys.stdout.flush()
        run = latest


@runs_app.command("logs")
def logs(
    run_id: RunArg,
    pod: Annotated[
        str | None,
        typer.Option("--pod", help="One pod (`spotrl runs logs RUN` names them); default: every pod of the run."),
    ] = None,
    tail: Annotated[int, typer.Option("--tail", min=1, max=2000, help="Lines from the end of each pod's log.")] = 100,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing new lines until the pod (or, without --pod, the run) ends."),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, help="Seconds between reads while following.")
    ] = 1.0,
    server: ServerOption = None,
    token: TokenOption = None,
    output: OutputOption = Output.TABLE,
) -> None:
    """Pods' logs through the API: from the launcher while a pod runs, else as kept when it ended.

    With --output json: the API's log objects; following, one {"pod", "line"} object per line."""
    with _api(server, token, output) as client:
        if follow:
            _follow_logs(client, run_id, pod, tail=tail, interval_s=interval, output=output)
            return
        names = [pod] if pod else [p["name"] for p in client.run_pods(run_id)["pods"]]
        pod_logs = [client.pod_log(run_id, name, tail=tail) for name in names]
    if output is Output.JSON:
        _print_json(pod_logs[0] if pod else {"run_id": run_id, "pods": pod_logs})
        return
    for log in pod_logs:
        if not pod:
            typer.echo(f"==> {log['pod']} ({'running' if log['running'] else 'ended'}) <==")
        for line in log["lines"]:
            typer.echo(line)


def _follow_logs(
    client: ApiClient, run_id: str, pod: str | None, *, tail: int, interval_s: float, output: Output
) -> None:
    """Poll the pods' log tails and print what is new, until the pod ends (with ``pod``) or the
    run has ended and none of its pods runs. Pods that appear meanwhile are printed from their start."""
    from contracts.status import RunStatus
    from services.client.api import new_lines

    seen: dict[str, list[str]] = {}  # pod -> its tail at the last read
    done: set[str] = set()  # ended pods whose kept log has been printed
    first = True

    def emit(name: str, lines: list[str]) -> None:
        for line in lines:
            if output is Output.JSON:
                typer.echo(json.dumps({"pod": name, "line": line}))
            else:
                typer.echo(line if pod else f"{name} | {line}")
        sys.stdout.flush()

    while True:
        run_ended = RunStatus(client.get_run(run_id)["status"]).is_terminal()
        pods = [{"name": pod, "running": None}] if pod else client.run_pods(run_id)["pods"]
        for p in pods:
            name = p["name"]
            if name in done:
                continue
            # A pod running when we started shows its last `tail` lines; one that appears later, all it kept.
            log = client.pod_log(run_id, name, tail=tail if first or name in seen else 2000)
            emit(name, new_lines(seen.get(name, []), log["lines"]))
            seen[name] = log["lines"]
            if not log["running"]:
                done.add(name)
        first = False
        if (pod and pod in done) or (not pod and run_ended and all(p["name"] in done for p in pods)):
            return
        time.sleep(interval_s)
        # Later reads ask for more than `tail`, so that a read overlaps the one before.
        tail = 2000


# --- the config file ----------------------------------------------------------------------------


@config_app.command("set-server")
def set_server(url: Annotated[str, typer.Argument(help="The API's URL, e.g. https://spotrl.example.com.")]) -> None:
    """Store the API server `spotrl runs` talks to when neither --server nor SPOTRL_SERVER is given."""
    from services.client.api import normalize_server, write_config

    path = write_config({"server": normalize_server(url)})
    typer.echo(f"server {normalize_server(url)} written to {path}")


@config_app.command("show")
def show(output: OutputOption = Output.TABLE) -> None:
    """The config file's server and whether it holds a token (never the token itself)."""
    from services.client.api import config_path, read_config

    config = read_config()
    shown = {
        "path": str(config_path()),
        "server": config.get("server"),
        "token": "set" if config.get("token") else None,
    }
    if output is Output.JSON:
        _print_json(shown)
    else:
        for key, value in shown.items():
            typer.echo(f"{key}: {value or '-'}")


def login(
    server: ServerOption = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", envvar="SPOTRL_TOKEN", help="The token the operator gave you (asked for when not given)."
        ),
    ] = None,
) -> None:
    """Check a token against the API server and store both in the config file (0600)."""
    from services.client.api import resolve_target, write_config

    if token is None:
        token = typer.prompt("token", hide_input=True)
    with _api(server, token, Output.TABLE) as client:
        next(iter(client.list_runs(page_size=1)), None)  # a 401 here: the token is not one the server knows
    target = resolve_target(server, token)
    path = write_config({"server": target.server, "token": token})
    typer.echo(f"logged in to {target.server}; server and token written to {path}")
