"""Math reward: 1.0 when a response's final answer equals the reference answer as a grader means it.

The answers are compared by math-verify (Hugging Face): it extracts the response's last
`\\boxed{}` (else a LaTeX or plain expression after "answer", else the last one in the text), parses
LaTeX and plain expressions into SymPy, and compares them symbolically and numerically, so that
"0.5", "$\\frac{1}{2}$" and "\\boxed{\\dfrac12}" are one answer, and "12 cm" is 12.

math-verify bounds its parsing and comparing with `signal.alarm`, which only works in a process's
main thread, while rewards are scored in worker threads; and some answers take SymPy unbounded
time or memory (`10^{10^{10}}` is evaluated exactly). So its own timeouts are turned off
(`parsing_timeout=None`, `timeout_seconds=None`) and it runs in worker processes of its own, under a
memory limit, each killed when it does not answer a response within the time limit (the response
then scores 0.0) and replaced.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.core.safe_regex import RewardError

log = logging.getLogger(__name__)

# Per response. math-verify decides an ordinary answer in milliseconds, a long symbolic one in
# well under a second; SymPy on a hostile answer would run for hours.
DEFAULT_TIMEOUT_S = 3.0
# Importing SymPy takes a second or two, more on a busy machine.
_STARTUP_TIMEOUT_S = 60.0
# Address space of a worker: SymPy needs a few hundred MB; `10^{10^{10}}` would take 4 GB.
_WORKER_MEMORY_BYTES = 2 * 2**30
# Checking answers is CPU-bound: more workers than cores only wait on each other.
_MAX_WORKERS = max(1, os.cpu_count() or 1)
_ROOT = Path(__file__).resolve().parents[3]  # the directory that holds the `services` package


def score(solution_str: str, ground_truth: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the final answer of `solution_str` is mathematically equivalent to `ground_truth`, else 0.0
    (also when none is found, or it is not decided within `timeout_s` seconds).
    Raises RewardError if math-verify cannot be started.

    >>> score("Half of them: so the answer is $\\\\boxed{\\\\frac{1}{2}}$.", "0.5")
    1.0
    """
    if not solution_str.strip() or not ground_truth.strip():
        return 0.0
    with _slots:
        with _lock:
            worker = _idle.pop() if _idle else None
        worker = worker or _Worker()
        result = worker.ask(solution_str, ground_truth, timeout_s)
        if result is None:
            log.warning(
                "math-verify gave no score for a response within %g s (stopped, or failed); it scores 0.0", timeout_s
            )
            worker.close()
            return 0.0
        with _lock:
            _idle.append(worker)
        return result


class _Worker:
    """A process running `_serve`: one JSON line in (a response and its reference), one out (its score)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from services.data.reward.verifiers.math import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=_ROOT,
        )
        self._buffer = b""
        if self._read_line(_STARTUP_TIMEOUT_S) != b"ready":
            self.close()
            raise RewardError(
                f"the math-verify worker did not start within {_STARTUP_TIMEOUT_S:g} s (is math-verify installed?)"
            )

    def ask(self, response: str, truth: str, timeout_s: float) -> float | None:
        """The score of `response`, or None if the worker did not answer within `timeout_s` (or died)."""
        try:
            self._proc.stdin.write(json.dumps({"response": response, "truth": truth}).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:  # it died (of its memory limit, say) since its last answer
            return None
        line = self._read_line(timeout_s)
        return None if line is None else float(line)

    def _read_line(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._proc.stdout], [], [], remaining)[0]:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc.stdin.close()
        self._proc.stdout.close()


_idle: list[_Worker] = []
_lock = threading.Lock()
_slots = threading.BoundedSemaphore(_MAX_WORKERS)


def _serve() -> None:
    """A worker's loop: read requests from stdin, answer each on stdout, until stdin closes."""
    resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    # It warns once that its timeouts are off, and once per answer it cannot parse.
    logging.disable(logging.WARNING)
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_targets = [LatexExtractionConfig()]
    # The last \boxed{} only (math-verify's default takes every \boxed{} of the response as a set).
    # Several in a row, separated by a comma or "and", still make one answer: `\boxed{1}, \boxed{2}`.
    last_boxed = NormalizationConfig(
        basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="last", equations=False
    )
    response_targets = [LatexExtractionConfig(normalization_config=last_boxed), ExprExtractionConfig()]
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        truth = request["truth"] if "\\boxed" in request["truth"] else "\\boxed{" + request["truth"] + "}"
        # math-verify catches its own errors (raise_on_error=False): an answer it cannot parse is no answer.
        gold = parse(truth, gold_targets, parsing_timeout=None)
        answer = parse(request["response"], response_targets, parsing_timeout=None)
        equal = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
        print(1.0 if equal else 0.0, flush=True)
