"""The entry points of the pods the scheduler starts, as hidden ``spotrl`` commands: ``worker``
(a rollout worker) and ``train-job`` (one training iteration), registered in ``services.cli``;
the launcher runs them as ``python -m services.cli ...``."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

from services.cli_common import start_logging

if TYPE_CHECKING:
    from services.config import Settings
    from services.runspec import RunSpec
    from services.wiring import Backends


@contextmanager
def _pod(run_id: str) -> Iterator[tuple[Settings, Backends, RunSpec]]:
    """What every pod starts with: logging, its torch threads, the backends and the run's spec."""
    from services.config import Settings
    from services.runspec import RunSpec
    from services.wiring import open_backends

    start_logging()
    settings = Settings()
    import torch

    # Local pods share this machine's cores; oversubscribed torch threads slow every pod down.
    torch.set_num_threads(settings.pod_threads)
    backends = open_backends(settings)
    try:
        yield settings, backends, RunSpec.from_stored(backends.state.get_run(run_id).spec)
    finally:
        backends.close()


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
    if spec.training.processes > 1:
        from trainer_core.rl.distributed import exit_rank

        exit_rank()  # a torchrun rank's normal exit can abort in gloo's threads: see exit_rank
