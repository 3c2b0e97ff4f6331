"""The ``spotrl`` command: serve, scheduler, demo, colocated training, the supervised steps
(``services.cli.supervised``), the entry points of the pods the scheduler starts
(``services.cli.pods``), and the client of a remote API (``spotrl runs``, ``services.client``)."""

from __future__ import annotations

import ipaddress
import os
import signal
from pathlib import Path
from typing import Annotated

import typer

from services.cli.common import HomeOption, load_settings, start_logging
from services.cli.pods import eval_job, reward_pod, train_job, worker
from services.cli.supervised import reward_server, sft, train_rm
from services.client.commands import Output, OutputOption, config_app, login, runs_app
from services.control.simulate.command import simulate_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help="spotrl: RL post-training at the lowest GPU bill.")
# The client of a remote API: torch-free (services.client), for laptops.
app.add_typer(runs_app, name="runs")
app.add_typer(config_app, name="config")
app.command("login")(login)
app.command("simulate")(simulate_command)


@app.command()
def serve(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    scheduler: Annotated[
        bool,
        typer.Option(
            "--scheduler/--no-scheduler",
            help="Run the reconcile loop in this process too; --no-scheduler serves the API alone, beside `spotrl scheduler` processes.",
        ),
    ] = True,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            "--insecure-no-auth",
            help="Development only: listen beyond loopback with no tokens file, open to anyone who can reach it.",
        ),
    ] = False,
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log",
            help="Log a line per request (method, path, status): some 0.1 ms of CPU a request, a tenth of a read's. "
            "Behind a load balancer, its log has them.",
        ),
    ] = False,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="API processes sharing the port, one per core the API may use: a Python process serves at most "
            "what one core gives it. The first also runs the scheduler, unless --no-scheduler.",
        ),
    ] = 1,
    home: HomeOption = None,
) -> None:
    """Run the REST API (and, unless --no-scheduler, the scheduler) on the embedded backends."""
    import uvicorn

    from services.control.api.auth import TokenBook, TokensFileError
    from services.control.api.http_server import uvicorn_options
    from services.control.api.main import create_app

    settings = load_settings(home)
    loopback = host == "localhost" or _is_loopback(host)
    if not loopback and settings.tokens_file is None and not insecure_no_auth:
        raise typer.BadParameter(
            f"refusing to listen on {host} without tokens: anyone who reaches it could spend this cluster's GPUs. "
            "Make tokens with `spotrl token add --tenant NAME --file tokens.json` and set SPOTRL_TOKENS_FILE, "
            "or pass --insecure-no-auth on a development machine.",
            param_hint="--host",
        )
    start_logging()
    try:
        if workers > 1:
            if settings.tokens_file is not None:  # each worker reads it again: a bad one stops the server here
                TokenBook(settings.tokens_file)
            from services.cli.serve_workers import serve_workers

            raise typer.Exit(
                serve_workers(host=host, port=port, workers=workers, scheduler=scheduler, access_log=access_log)
            )
        app = create_app(settings, with_scheduler=scheduler)
    except TokensFileError as e:
        raise typer.BadParameter(str(e), param_hint="SPOTRL_TOKENS_FILE") from None
    uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_options(settings, access_log=access_log))  # type: ignore[arg-type]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


token_app = typer.Typer(no_args_is_help=True, help="The API's bearer tokens (stored hashed in a tokens file).")
app.add_typer(token_app, name="token")


@token_app.command("add")
def token_add(
    tenant: Annotated[
        str, typer.Option(help="Tenant the token acts for: it sees that tenant's runs and objects only.")
    ],
    file: Annotated[
        Path, typer.Option("--file", help="Tokens file (created 0600); the API reads it from SPOTRL_TOKENS_FILE.")
    ],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin token: sees every tenant's runs and /metrics.")
    ] = False,
    label: Annotated[str, typer.Option(help="A note kept beside the hash, e.g. who holds the token.")] = "",
) -> None:
    """Make a token, store its hash in FILE and print the token: the only time it is shown."""
    from services.control.api.auth import TokensFileError, add_token

    try:
        typer.echo(add_token(file, tenant=tenant, admin=admin, label=label))
    except TokensFileError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def plan(
    file: Annotated[
        Path, typer.Argument(metavar="FILE", help="What to plan, YAML or JSON: the body of POST /v1/plan.")
    ],
    output: OutputOption = Output.TABLE,
) -> None:
    """Plan a run's bill before starting it: the rollout pool and training shape, the cost per update
    and per day against always-on, each term's arithmetic (prices: SPOTRL_PRICE_CATALOG or given)."""
    import yaml
    from pydantic import ValidationError

    from services.control.cost.plan_schemas import PlanRequest, plan_public, plan_request
    from services.control.cost.plan_text import format_plan
    from services.control.cost.planner import PlanError
    from services.ports.prices.catalog import load_catalog

    try:
        data = yaml.safe_load(file.read_text())  # JSON is YAML too
        result = plan_request(PlanRequest.model_validate(data), load_catalog())
    except OSError as e:
        raise typer.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="FILE") from None
    except yaml.YAMLError as e:
        raise typer.BadParameter(f"{file} is neither YAML nor JSON: {e}", param_hint="FILE") from None
    except ValidationError as e:
        raise typer.BadParameter(
            f"{file} is not a plan request (see POST /v1/plan in the API's /docs):\n{e}", param_hint="FILE"
        ) from None
    except PlanError as e:
        where = ".".join(map(str, e.loc))
        raise typer.BadParameter(f"{where}: {e}", param_hint="FILE") from None
    typer.echo(plan_public(result).model_dump_json(indent=2) if output is Output.JSON else format_plan(result))


@app.command("scheduler")
def scheduler_command(
    home: HomeOption = None,
    health_port: Annotated[
        int | None,
        typer.Option(
            help="Serve /healthz (the loop goes round) and /readyz (it has reached the state store) on this port, for Kubernetes' probes."
        ),
    ] = None,
) -> None:
    """Run the scheduler's reconcile loop alone: one of several leads, the others stand by.

    The holder of the scheduler lease in the state store reconciles; a standby takes over within
    a lease period when it dies. SIGTERM or Ctrl-C stops it cleanly and releases the lease.
    """
    import threading

    from services.control.scheduler.health import Heartbeat, serve_health
    from services.control.scheduler.loop import Scheduler
    from services.ports.wiring import open_backends

    start_logging()
    settings = load_settings(home)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    heartbeat = Heartbeat()
    health = serve_health(heartbeat, health_port) if health_port is not None else None
    backends = open_backends(settings)
    try:
        Scheduler(backends, settings).run_forever(stop, heartbeat.beat)  # releases the lease on the way out
    finally:
        backends.close()
        if health is not None:
            health.shutdown()


@app.command()
def teardown(
    grace_s: Annotated[
        float, typer.Option("--grace-s", min=0, help="Seconds each pod gets between SIGTERM and SIGKILL.")
    ] = 30.0,
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout-s",
            min=0,
            help="After this long, every pod still there is deleted at once (SIGKILL, its finalizer removed).",
        ),
    ] = 240.0,
    namespace: Annotated[
        str | None, typer.Option(help="Namespace of the pods; default: SPOTRL_KUBE_NAMESPACE.")
    ] = None,
    home: HomeOption = None,
) -> None:
    """Stop and delete every pod and Job the scheduler launched, and end every run in the state store
    (cancelled, or with the end it was ending with): what an uninstall does first (the Helm chart's
    pre-delete hook). Exits 1 if pods are left.

    Run it where the scheduler runs (its settings: SPOTRL_LAUNCHER, SPOTRL_KUBE_*, SPOTRL_STATE_URL);
    a state store it cannot reach is left as it is, and the pods still go.
    """
    from services.control.scheduler.teardown import open_state
    from services.control.scheduler.teardown import teardown as tear_down
    from services.ports.wiring import open_launcher

    start_logging()
    settings = load_settings(home)
    if namespace is not None:
        settings = settings.model_copy(update={"kube_namespace": namespace})
    launcher = open_launcher(settings, settings.home.resolve(), read_nodes=False)
    state = open_state(settings.resolved_state_url())
    try:
        report = tear_down(launcher, state, grace_s=grace_s, timeout_s=timeout_s)
    finally:
        launcher.close()
        if state is not None:
            state.close()
    deleted = ", ".join(f"{name} ({outcome.value})" for name, outcome in sorted(report.pods.items())) or "none"
    typer.echo(f"pods deleted: {deleted}")
    typer.echo(f"runs ended: {', '.join(report.ended_runs) or 'none'}")
    if report.left:
        typer.echo(f"pods left: {', '.join(report.left)}", err=True)
        raise typer.Exit(1)


@app.command()
def demo(
    model: Annotated[
        str, typer.Option(help="Base model: smollm2-135m, tiny, a HF directory or a .gguf file.")
    ] = "smollm2-135m",
    summary_json: Annotated[Path | None, typer.Option("--summary-json", help="Write the run's summary here.")] = None,
    chaos: Annotated[
        bool,
        typer.Option(
            "--chaos",
            help="During the run, SIGKILL rollout workers, a training job between publish and commit, and the scheduler "
            "(restarted each time), and preempt two training jobs on spot mid-update (with a notice and without), "
            "then audit the run: nothing lost, trained twice or left unbilled.",
        ),
    ] = False,
    iterations: Annotated[
        int | None,
        typer.Option(min=1, help="Training iterations (default: 3 for tiny, 5 otherwise); fewer make a quicker check."),
    ] = None,
    home: HomeOption = None,
) -> None:
    """Train a policy on small arithmetic with GRPO, end to end on this machine, and print the bill."""
    import time

    from services.tooling.chaos_plan import ChaosPlan
    from services.tooling.demo import run_demo

    # A fresh state directory per demo; converted base models are cached across demos.
    os.environ.setdefault("SPOTRL_MODEL_CACHE", str(Path(".spotrl/models").resolve()))
    home = home or Path(".spotrl") / time.strftime("demo-%Y%m%d-%H%M%S")
    ok = run_demo(
        model=model,
        settings=load_settings(home),
        summary_json=summary_json,
        chaos=ChaosPlan(training_preemptions=2) if chaos else None,
        iterations=iterations,
    )
    raise typer.Exit(0 if ok else 1)


@app.command()
def train(
    colocated: Annotated[
        Path | None,
        typer.Option(
            "--colocated",
            metavar="SPEC_FILE",
            help="Run spec (YAML or JSON) to train in this process, rollout and training on one device.",
        ),
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Output directory: checkpoints/ and the final policy/.")] = Path(
        "spotrl-out"
    ),
    resume: Annotated[bool, typer.Option("--resume", help="Continue after the latest checkpoint in --out.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of a fresh run (a resumed run continues its own RNG streams).")] = 0,
    device: Annotated[str | None, typer.Option(help="torch device; default cuda when available, else cpu.")] = None,
    home: HomeOption = None,
) -> None:
    """Train a run spec colocated: one process, one device, one copy of the weights."""
    if colocated is None:
        raise typer.BadParameter(
            "only colocated runs are trained here: give --colocated SPEC_FILE. Disaggregated runs "
            "(spot rollout pool, on-demand training jobs) are submitted with `spotrl serve` and POST /v1/runs.",
            param_hint="--colocated",
        )
    from services.data.colocated import IterationRecord, ResumeError, SpecFileError, load_spec_file, run_colocated
    from services.domain.prompts import InvalidPromptsError, is_store_uri
    from services.ports.objects.local_object_store import LocalObjectStore

    try:
        spec = load_spec_file(colocated)
    except SpecFileError as e:
        raise typer.BadParameter(str(e), param_hint="--colocated") from None
    start_logging()
    settings = load_settings(home)
    # store:// prompt sets are read from the embedded object store of --home.
    objects = LocalObjectStore(settings.home.resolve() / "objects") if is_store_uri(spec.prompts) else None

    def show(record: IterationRecord) -> None:
        typer.echo(
            f"iteration {record.iteration}: mean reward {record.mean_reward:.4f} ({record.samples} samples, "
            f"rollout {record.rollout_seconds:.1f} s, train {record.train_seconds:.1f} s)"
        )

    try:
        result = run_colocated(
            spec,
            out_dir=out,
            model_cache=settings.resolved_model_cache(),
            objects=objects,
            resume=resume,
            seed=seed,
            device=device,
            on_iteration=show,
        )
    except (InvalidPromptsError, ResumeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"stopped: {result.stop_reason} after {len(result.iterations)} iterations; final policy in {result.policy_dir}"
    )
    typer.echo(str(result.cost))


# Supervised steps before PPO (services.cli.supervised), then the pods' entry points (services.cli.pods).
app.command()(sft)
app.command("train-rm")(train_rm)
app.command("reward-server")(reward_server)
app.command(hidden=True)(worker)
app.command("train-job", hidden=True)(train_job)
app.command("eval-job", hidden=True)(eval_job)
app.command("reward-pod", hidden=True)(reward_pod)


@app.command()
def logs(
    pod: str,
    tail: Annotated[int, typer.Option(help="Lines to show.")] = 100,
    home: HomeOption = None,
) -> None:
    """Show the last lines of a pod's log (running, or ended and kept by the scheduler), on the
    server's machine; from elsewhere, `spotrl runs logs RUN --pod POD` asks the API."""
    from services.control.api.service import PodNotOfRunError, read_pod_log
    from services.ports.wiring import open_backends

    backends = open_backends(load_settings(home))
    try:
        typer.echo(read_pod_log(backends, pod, tail=tail)[0])
    except PodNotOfRunError:
        raise typer.BadParameter(f"no pod {pod!r}, running or ended, in {backends.state.url}") from None
    finally:
        backends.close()


@app.command()
def report(
    run_id: str,
    out: Annotated[
        Path | None, typer.Option("--out", help="The HTML file to write [default: <run>-report.html].")
    ] = None,
    home: HomeOption = None,
) -> None:
    """Write the run's report page: one HTML file that works offline (reward by iteration, cumulative
    cost against always-on and the lower bound, pod timelines with preemptions marked), on the
    server's machine; from elsewhere, GET /v1/runs/RUN/report."""
    from services.control.api.service import report_page_of
    from services.ports.prices.catalog import load_catalog
    from services.ports.state.state_store import RunNotFoundError
    from services.ports.wiring import open_backends

    backends = open_backends(load_settings(home))
    try:
        page = report_page_of(backends.state, load_catalog(), backends.state.get_run(run_id))
    except RunNotFoundError:
        raise typer.BadParameter(
            f"no run {run_id!r} in {backends.state.url}: `spotrl runs list` shows the runs"
        ) from None
    finally:
        backends.close()
    path = out or Path(f"{run_id}-report.html")
    path.write_text(page, encoding="utf-8")
    typer.echo(str(path))


if __name__ == "__main__":
    app()
