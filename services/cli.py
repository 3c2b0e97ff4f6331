"""The ``spotrl`` command: serve, demo, and the entry points of the pods the scheduler starts."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from services.config import Settings
    from services.runspec import RunSpec
    from services.wiring import Backends

app = typer.Typer(add_completion=False, no_args_is_help=True, help="spotrl: RL post-training at the lowest GPU bill.")

HomeOption = Annotated[
    Path | None, typer.Option("--home", help="State directory of the embedded backends [env SPOTRL_HOME].")
]


def _settings(home: Path | None) -> Settings:
    from services.config import Settings

    if home is not None:
        os.environ["SPOTRL_HOME"] = str(home)
    return Settings()


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def serve(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    home: HomeOption = None,
) -> None:
    """Run the REST API and the scheduler on the embedded backends."""
    import uvicorn

    from services.api.main import create_app

    _logging()
    uvicorn.run(create_app(_settings(home)), host=host, port=port, log_level="info")


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="Base model: smollm2-135m, tiny, a HF directory or a .gguf file.")] = "smollm2-135m",
    summary_json: Annotated[Path | None, typer.Option("--summary-json", help="Write the run's summary here.")] = None,
    home: HomeOption = None,
) -> None:
    """Train a policy on small arithmetic with GRPO, end to end on this machine, and print the bill."""
    import time

    from services.demo import run_demo

    # A fresh state directory per demo; converted base models are cached across demos.
    os.environ.setdefault("SPOTRL_MODEL_CACHE", str(Path(".spotrl/models").resolve()))
    home = home or Path(".spotrl") / time.strftime("demo-%Y%m%d-%H%M%S")
    ok = run_demo(model=model, settings=_settings(home), summary_json=summary_json)
    raise typer.Exit(0 if ok else 1)


@contextmanager
def _pod(run_id: str) -> Iterator[tuple[Settings, Backends, RunSpec]]:
    """What every pod starts with: logging, its torch threads, the backends and the run's spec."""
    from services.config import Settings
    from services.runspec import RunSpec
    from services.wiring import open_backends

    _logging()
    settings = Settings()
    import torch

    # Local pods share this machine's cores; oversubscribed torch threads slow every pod down.
    torch.set_num_threads(settings.pod_threads)
    backends = open_backends(settings)
    try:
        yield settings, backends, RunSpec.from_stored(backends.state.get_run(run_id).spec)
    finally:
        backends.close()


@app.command(hidden=True)
def worker(
    run_id: str,
    worker_id: Annotated[str, typer.Option("--worker-id")],
) -> None:
    """Pod entry point: a rollout worker of RUN_ID."""
    from services.rollout.worker import RolloutWorker, StopSignal

    with _pod(run_id) as (settings, backends, spec):
        stop = StopSignal(settings.stop_grace_s)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        RolloutWorker(
            run_id=run_id,
            worker_id=worker_id,
            spec=spec,
            state=backends.state,
            queue=backends.queue,
            objects=backends.objects,
            rewards=backends.rewards,
            model_cache=settings.resolved_model_cache(),
            session_timeout_s=settings.session_timeout_s,
            stop=stop,
        ).run()


@app.command("train-job", hidden=True)
def train_job(run_id: str, iteration: int) -> None:
    """Pod entry point: training iteration ITERATION of RUN_ID."""
    from services.training.job import run_training_job

    with _pod(run_id) as (settings, backends, spec):
        run_training_job(
            run_id=run_id,
            iteration=iteration,
            spec=spec,
            queue=backends.queue,
            objects=backends.objects,
            model_cache=settings.resolved_model_cache(),
        )


@app.command()
def logs(
    pod: str,
    tail: Annotated[int, typer.Option(help="Lines to show.")] = 100,
    home: HomeOption = None,
) -> None:
    """Show the last lines of a pod's log (running, or ended and kept by the scheduler)."""
    from services.backends.launcher import PodNotFoundError
    from services.backends.object_store import ObjectNotFoundError
    from services.names import pod_log_key, run_id_of_pod
    from services.wiring import open_backends

    backends = open_backends(_settings(home))
    try:
        typer.echo(backends.launcher.logs(pod, tail=tail))
    except PodNotFoundError:
        try:
            text = backends.objects.get_bytes(pod_log_key(run_id_of_pod(pod), pod)).decode()
        except ObjectNotFoundError:
            raise typer.BadParameter(f"no pod {pod!r}, running or ended, in {backends.state.url}") from None
        typer.echo("".join(text.splitlines(keepends=True)[-tail:]))
    finally:
        backends.close()


if __name__ == "__main__":
    app()
