"""The entry points of the pods the scheduler starts, as hidden ``spotrl`` commands: ``worker``
(a rollout worker), ``train-job`` (one training iteration) and ``eval-job`` (one policy version's
held-out evaluation), registered in ``services.cli.main``;
the launcher runs them as ``python -m services.cli.main ...``."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

from services.cli.common import start_logging

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.core.config import Settings
    from services.domain.reward_spec import RewardTerm
    from services.domain.runspec import RunSpec
    from services.ports.state.state_store import StateStore
    from services.ports.wiring import Backends


MEMORY_REPORT_S = 30.0


@contextmanager
def _pod(run_id: str) -> Iterator[tuple[Settings, Backends, RunSpec]]:
    """What every pod starts with: logging, its torch threads, the backends and the run's spec;
    and while it runs, its memory reported every MEMORY_REPORT_S seconds."""
    from services.core.config import Settings
    from services.domain.runspec import RunSpec
    from services.ports.wiring import open_backends

    start_logging()
    settings = Settings()
    import torch

    # Local pods share this machine's cores; oversubscribed torch threads slow every pod down.
    torch.set_num_threads(settings.pod_threads)
    backends = open_backends(settings)
    try:
        with _memory_reported(backends.state, run_id):
            yield settings, backends, RunSpec.from_stored(backends.state.get_run(run_id).spec)
    finally:
        backends.close()


@contextmanager
def _memory_reported(state: StateStore, run_id: str) -> Iterator[None]:
    """Report this pod's memory (GPU memory where it has a GPU, else its RSS) to the state store
    now and every MEMORY_REPORT_S seconds until the block ends, from a thread of its own: the
    run's experiment trackers show it over time. Only a pod the scheduler started knows its name."""
    import torch

    from services.ports.launcher.launcher import POD_NAME_ENV, POD_ROLE_ENV
    from trainer_core.memory import MemoryMonitor

    pod, role = os.environ.get(POD_NAME_ENV), os.environ.get(POD_ROLE_ENV, "")
    if not pod or os.environ.get("RANK", "0") != "0":  # a training pod's ranks: its leader reports
        yield
        return
    monitor = MemoryMonitor(torch.device("cuda") if torch.cuda.is_available() else None)
    stop = threading.Event()

    def report() -> None:
        while True:
            m = monitor.sample()
            try:
                state.report_memory(
                    run_id, pod, role, at=time.time(), current=m["perf/memory_bytes"], peak=m["perf/peak_memory_bytes"]
                )
            except Exception as e:  # a lost report is one point fewer on a chart, never the pod's end
                log.warning("memory report not stored (%s); the next in %.0f s", type(e).__name__, MEMORY_REPORT_S)
            if stop.wait(MEMORY_REPORT_S):
                return

    thread = threading.Thread(target=report, name="memory-report", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5.0)


def worker(
    run_id: str,
    worker_id: Annotated[str, typer.Option("--worker-id")],
) -> None:
    """Pod entry point: a rollout worker of RUN_ID. A run its workers cannot serve (prompts its
    model cannot render, a reward that cannot load) is failed with the reason, not retried."""
    from contracts.status import RunStatus
    from services.core.errors import PermanentError
    from services.data.rollout.worker import RolloutWorker, StopSignal

    with _pod(run_id) as (settings, backends, spec):
        stop = StopSignal(settings.stop_grace_s)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
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
        except PermanentError as e:
            backends.state.begin_ending(run_id, RunStatus.FAILED, str(e))
            raise typer.Exit(1) from None


def train_job(run_id: str, iteration: int) -> None:
    """Pod entry point: training iteration ITERATION of RUN_ID."""
    from services.data.training.job import run_training_job
    from services.ports.launcher.launcher import POD_CAPACITY_ENV

    with _pod(run_id) as (settings, backends, spec):
        run_training_job(
            run_id=run_id,
            iteration=iteration,
            spec=spec,
            queue=backends.queue,
            objects=backends.objects,
            model_cache=settings.resolved_model_cache(),
            # A pod started without its capacity (by hand) checkpoints as a spot one would.
            on_spot=os.environ.get(POD_CAPACITY_ENV) != "on-demand",
        )
    if spec.training.ranks > 1:
        from trainer_core.rl.distributed import exit_rank

        exit_rank()  # a torchrun rank's normal exit can abort in gloo's threads: see exit_rank


def eval_job(run_id: str, version: int) -> None:
    """Pod entry point: the held-out evaluation of policy VERSION of RUN_ID."""
    from services.data.rollout.evaluation import run_eval_job

    with _pod(run_id) as (settings, backends, spec):
        terms = _reward_terms(backends.state, run_id, spec)
        run_eval_job(
            run_id=run_id,
            version=version,
            spec=spec,
            terms=terms,
            objects=backends.objects,
            model_cache=settings.resolved_model_cache(),
        )


def _reward_terms(state: StateStore, run_id: str, spec: RunSpec, wait_s: float = 600.0) -> list[RewardTerm]:
    """The run's reward terms as its pods run them: with a reward server, its term scored where the
    server listens, waited for up to ``wait_s`` (a pod that gives up fails, and is retried)."""
    if spec.reward_server is None:
        return list(spec.reward)
    deadline = time.monotonic() + wait_s
    while (url := state.reward_url(run_id)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reward server of run {run_id} has not said where it listens in {wait_s:.0f} s")
        time.sleep(1.0)
    return spec.reward_terms(url)


def reward_pod(run_id: str) -> None:
    """Pod entry point: the reward server of RUN_ID, serving the run's reward term with a `path`
    until stopped, and telling the state store where it listens (the rollout workers and eval
    pods read it there). On Kubernetes it listens on SPOTRL_REWARD_PORT at the pod's address
    (SPOTRL_POD_IP); elsewhere on a free loopback port. A function that cannot be served fails
    the run at once with the reason."""
    import socket
    from pathlib import Path

    import uvicorn

    from contracts.status import RunStatus
    from services.data.reward.function_pool import FunctionPool
    from services.data.reward.service import create_reward_app
    from services.data.reward.user_function import UserFunctionError, resolve
    from services.domain.reward_spec import RewardFn

    with _pod(run_id) as (settings, backends, spec):
        served = spec.served_term()
        if served is None:
            raise typer.BadParameter(f"run {run_id} asks for no reward server")
        term = spec.reward[served]
        if term.fn == RewardFn.FUNCTION:
            try:
                app = create_reward_app(pool=FunctionPool(resolve(term.path or "")).start())
            except UserFunctionError as e:
                backends.state.begin_ending(run_id, RunStatus.FAILED, f"reward function {term.path}: {e}")
                raise typer.Exit(1) from None
        else:
            app = create_reward_app(Path(term.path or ""), quantize=term.quantize)
        address = os.environ.get("SPOTRL_POD_IP")
        listener = socket.create_server(
            ("0.0.0.0" if address else "127.0.0.1", int(os.environ.get("SPOTRL_REWARD_PORT", "0")))
        )
        url = f"http://{address or '127.0.0.1'}:{listener.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="reward-server")
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.1)
        if server.started:
            backends.state.update_run(run_id, reward_url=url)
            log.info("reward server of run %s listening at %s", run_id, url)
        thread.join()
