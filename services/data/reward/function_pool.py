"""A pool of worker processes that run a user's reward function, contained.

Each worker loads the function once and then scores what it is sent: one response per call, or
one chunk of a batch for a batched function. Every call has a time limit and every worker a
memory limit (``RLIMIT_AS``, set in the worker). A call that raises, hangs, kills its process or
returns something that is not a finite number scores 0.0 with a failure reason (`Failure`); a
worker that hung or died is killed (with anything it started) and replaced. The pool itself
never fails for what the function does, and never carries user code's exception text.

Workers start from a fork server, not by forking this process: the parent serves HTTP and
holds threads.

Example::

    with FunctionPool(resolve("rewards.py:compute_score"), workers=2, timeout_s=5.0) as pool:
        pool.score([Item("#### 42", "42"), Item("I don't know", "42")])
        # [Outcome(score=1.0, ...), Outcome(score=0.0, ...)]
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import multiprocessing
import os
import queue
import resource
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait

from services.data.reward.user_function import (
    CallStyle,
    Failure,
    Item,
    Outcome,
    UserFunction,
    UserFunctionError,
    call,
    call_style,
    load,
)

log = logging.getLogger(__name__)

MAX_CHUNK = 256  # items in one call of a batched function
_CONTEXT = multiprocessing.get_context("forkserver")


class _Lost(Exception):
    """The worker hung or died in a call."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure


def _serve(conn: Connection, function: UserFunction, memory_mb: int) -> None:
    """A worker's life: load the function, report how to call it, then score until told to stop."""
    os.setsid()  # its own process group: a kill takes whatever the function started with it
    _exit_with_parent()
    if memory_mb > 0:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = memory_mb << 20 if hard == resource.RLIM_INFINITY else min(memory_mb << 20, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        fn = load(function)
        style = call_style(fn, function)
    except UserFunctionError as e:
        conn.send(("failed", str(e)))
        return
    conn.send(("loaded", style))
    while True:
        try:
            items = conn.recv()
        except EOFError:  # the pool closed
            return
        conn.send(call(fn, style, items))


def _exit_with_parent() -> None:
    """Leave when the server does, even in the middle of a hung call."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        sentinel = parent.sentinel

        def watch() -> None:
            wait([sentinel])
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()


class _Worker:
    def __init__(self, function: UserFunction, memory_mb: int) -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve, args=(child, function, memory_mb), name="spotrl-reward-function")
        self.process.start()
        child.close()
        self.style: CallStyle | None = None

    def loaded(self, timeout_s: float) -> CallStyle:
        """How to call the function, once the worker has loaded it; UserFunctionError if it could not."""
        if self.style is None:
            if not wait([self.conn, self.process.sentinel], timeout_s):
                raise UserFunctionError(f"the reward function did not load within {timeout_s:g} s")
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                raise UserFunctionError("the reward function's worker died while loading it (out of memory?)") from None
            if kind == "failed":
                raise UserFunctionError(value)
            self.style = value
        return self.style

    def call(self, items: Sequence[Item], timeout_s: float) -> list[Outcome]:
        """The function's outcomes for ``items``; _Lost when the worker hangs past ``timeout_s`` or dies."""
        deadline = time.monotonic() + timeout_s
        try:
            self.conn.send(list(items))
            if self.conn in wait([self.conn, self.process.sentinel], timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):
            pass  # it died: its exit code says how
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.exitcode is None:
            raise _Lost(Failure.TIMEOUT)
        # Killed without our asking: the kernel's out-of-memory killer.
        raise _Lost(Failure.MEMORY if self.process.exitcode == -signal.SIGKILL else Failure.CRASH)

    def kill(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):  # not yet a group leader
                os.killpg(self.process.pid, signal.SIGKILL)  # its group: it called setsid
            self.process.kill()
        self.process.join()
        # The thread of a call in progress may be closing it too, having seen its worker die.
        with contextlib.suppress(OSError):
            self.conn.close()


class FunctionPool:
    """``workers`` processes running one user reward function; see the module docstring."""

    def __init__(
        self,
        function: UserFunction,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 4096,
        load_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1 or timeout_s <= 0 or memory_mb < 0:
            raise ValueError(
                "a pool needs at least one worker, a positive time limit and a memory limit >= 0 (0: none)"
            )
        self.function = function
        self.workers, self.timeout_s, self.memory_mb, self.load_timeout_s = (
            workers,
            timeout_s,
            memory_mb,
            load_timeout_s,
        )
        self.batched = False
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._executor: ThreadPoolExecutor | None = None
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def fingerprint(self) -> str:
        return self.function.fingerprint

    def start(self) -> FunctionPool:
        """Start the workers and wait until each has loaded the function; UserFunctionError
        (the pool closed) when it does not import, is missing or has the wrong signature."""
        if self._closed:
            raise RuntimeError("the reward function pool is closed")
        if self._executor is not None:
            return self
        started = [w for _ in range(self.workers) if (w := self._spawn()) is not None]
        try:
            self.batched = [w.loaded(self.load_timeout_s) for w in started][0].batched
        except UserFunctionError:
            self.close()
            raise
        for w in started:
            self._idle.put(w)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="reward-function")
        atexit.register(self.close)  # before multiprocessing's own exit hook joins the workers
        return self

    def score(self, items: Sequence[Item]) -> list[Outcome]:
        """An outcome per item, in order: spread over the workers, a chunk per call when batched."""
        if self._executor is None or self._closed:
            raise RuntimeError("the reward function pool is not running")
        size = min(MAX_CHUNK, math.ceil(len(items) / self.workers)) if self.batched else 1
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        futures = [self._executor.submit(self._run, chunk) for chunk in chunks]
        return [o for f in futures for o in f.result()]

    def _run(self, chunk: Sequence[Item]) -> list[Outcome]:
        worker: _Worker | None = self._idle.get()
        assert worker is not None
        try:
            worker.loaded(self.load_timeout_s)  # a replacement loads while its predecessor's call is reported
            return worker.call(chunk, self.timeout_s)
        except (_Lost, UserFunctionError) as e:
            failure = e.failure if isinstance(e, _Lost) else Failure.EXCEPTION
            log.warning("reward function: a call failed (%s); its worker is replaced", failure)
            self._retire(worker)
            worker = self._spawn()
            return [Outcome.failed(failure)] * len(chunk)
        finally:
            if worker is not None:
                self._idle.put(worker)

    def _spawn(self) -> _Worker | None:
        """A new worker; None once the pool is closed."""
        worker = _Worker(self.function, self.memory_mb)
        with self._lock:
            if not self._closed:
                self._all.add(worker)
                return worker
        worker.kill()  # the pool closed while it started
        return None

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def close(self) -> None:
        """Stop every worker, in a call or not."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()
        atexit.unregister(self.close)

    def __enter__(self) -> FunctionPool:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()
