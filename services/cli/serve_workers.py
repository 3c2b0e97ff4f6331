"""`spotrl serve --workers N`: N API processes sharing one listening socket.

A Python process runs one thread at a time, so one API process serves at most what one core
gives it: more load wants more processes. The parent binds the port and starts each worker (a
fresh interpreter: ``spawn``) on that socket; the kernel hands each new connection to one of
them. Worker 0 also runs the scheduler when asked (one leads anyway: the lease in the state
store); the others serve the API alone. Each keeps what it computed between requests
(``services.control.api.kept``) for itself: nothing kept can go stale, so they need not agree.
Stopped (SIGTERM or SIGINT), the parent stops the workers, which finish the requests in flight;
when a worker exits of itself, it stops the others and exits with that worker's status, for the
process manager to restart.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from services.cli.common import load_settings, start_logging


def serve_workers(*, host: str, port: int, workers: int, scheduler: bool, access_log: bool) -> int:
    """Serve on ``host:port`` from ``workers`` processes until they are stopped; the exit status."""
    sock = uvicorn.Config(app=None, host=host, port=port).bind_socket()  # type: ignore[arg-type]
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(target=_worker, args=(sock, scheduler and i == 0, access_log), name=f"api-{i}")
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    sock.close()  # the workers hold it

    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        # SIGTERM whichever came: a Ctrl+C reaches the workers too, and a second SIGINT would make
        # uvicorn drop the requests in flight.
        nonlocal stopping
        stopping = True
        _signal_all(procs, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ready = wait([proc.sentinel for proc in procs])
    # A sentinel is ready as the worker's process ends, maybe before its exit status is: wait for it.
    ended = next(proc for proc in procs if proc.sentinel in ready)
    ended.join()
    first = ended.exitcode
    assert first is not None
    _signal_all(procs, signal.SIGTERM)
    for proc in procs:
        proc.join()
    if stopping:  # uvicorn ends a stopped worker by its signal again, once its requests are done
        return 0
    return first if first >= 0 else 128 - first  # a worker ended by a signal, as a shell reports it


def _signal_all(procs: list[BaseProcess], signum: int) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(proc.pid, signum)


def _worker(sock: socket.socket, with_scheduler: bool, access_log: bool) -> None:
    """One API process: the app on the shared socket (SPOTRL_HOME and the settings come from the parent's environment)."""
    from services.control.api.http_server import uvicorn_options
    from services.control.api.main import create_app

    settings = load_settings(None)
    start_logging()
    app = create_app(settings, with_scheduler=with_scheduler)
    config = uvicorn.Config(app, log_level="info", **uvicorn_options(settings, access_log=access_log))  # type: ignore[arg-type]
    uvicorn.Server(config).run(sockets=[sock])
