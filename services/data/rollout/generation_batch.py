"""How many sequences a rollout worker's engine generates at once: sized from the memory free,
grown while there is room, halved on an out-of-memory error instead of failing the batch.

A worker's batch (its prompts times ``samples_per_prompt``) is generated in chunks of ``size``
sequences. The first chunk, before anything is measured, is the whole batch. Before each later
chunk the size is set from the memory free then (GPU memory on CUDA; on a CPU the memory the
system has available, within the process's address-space limit if it has one) at what a
sequence was measured to take, at most doubling from one chunk to the next and never above what
is left of the batch. An engine whose generation grows no memory the probe sees (vLLM reserves
its KV cache up front and schedules the batch itself) gets the whole batch each time.

An out-of-memory error halves the size and the chunk is generated again at that size; at one
sequence it is the batch's failure. A chunk that ran out says that a sequence takes more than
the memory free then over the chunk's size: the measure per sequence is never below that, and
no chunk is ever again as large as one that ran out.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer_core.engines.hf import Completion, GenerationEngine, SamplingParams, never

log = logging.getLogger(__name__)

# The share of the free memory a chunk may take (the rest: the allocator's slack, the rewards).
FREE_SHARE = 0.8


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's, Python's, or torch's CPU allocator's (a RuntimeError)."""
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


@dataclass(frozen=True)
class MemoryProbe:
    """This process's memory on ``device``: what is free, what is in use, and the peak since
    ``start`` (on CUDA the allocator's tensor bytes; on a CPU the resident set)."""

    device: torch.device

    def free(self) -> float:
        """Bytes it could still allocate: free GPU memory on CUDA; else the system's available
        memory, within the address-space limit (RLIMIT_AS) if the process has one."""
        if self.device.type == "cuda":
            return float(torch.cuda.mem_get_info(self.device)[0])
        free = _proc_kib("/proc/meminfo", "MemAvailable") * 1024.0
        limit, _ = resource.getrlimit(resource.RLIMIT_AS)
        if limit != resource.RLIM_INFINITY:
            free = min(free, limit - _proc_kib("/proc/self/status", "VmSize") * 1024.0)
        return max(0.0, free)

    def start(self) -> float:
        """Bytes in use now; the peak counts from here."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return float(torch.cuda.memory_allocated(self.device))
        # Resets the peak resident set (VmHWM) to now; where it cannot, the peak counts from the
        # process's start and a chunk looks larger than it is.
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        return _proc_kib("/proc/self/status", "VmRSS") * 1024.0

    def peak(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return _proc_kib("/proc/self/status", "VmHWM") * 1024.0


def _proc_kib(path: str, key: str) -> float:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return math.inf


@dataclass
class GenerationBatch:
    """The chunk size of a worker's generation, and its history (``sizes``: time, size)."""

    per_sequence_bytes: float | None = None  # measured: what a chunk's generation took per sequence
    size: int | None = None  # None: nothing generated yet
    sizes: list[tuple[float, int]] = field(default_factory=list)
    retry: bool = False  # the last chunk ran out of memory: the next one is ``size``, as halved
    ran_out_at: int | None = None  # the fewest sequences that ran out of memory: never tried again
    at_once: int = 0  # the most sequences generated at once in the latest ``generate_in_chunks``

    def next_size(self, pending: int, free_bytes: float) -> int:
        """The size of the next chunk of the ``pending`` sequences left (module docstring)."""
        if self.size is None:
            size = pending
        elif self.retry:
            size = min(pending, self.size)
        elif not self.per_sequence_bytes:
            # Generating grew no memory the probe sees (an engine with its own KV cache reserved up
            # front, as vLLM's): the whole batch, the engine schedules it.
            size = pending
        else:
            size = max(1, min(pending, 2 * self.size, math.floor(FREE_SHARE * free_bytes / self.per_sequence_bytes)))
        if self.ran_out_at is not None:
            size = min(size, self.ran_out_at - 1)
        self.retry = False
        self._set(size)
        return size

    def measured(self, sequences: int, grew_bytes: float) -> None:
        """A chunk of ``sequences`` made memory grow by ``grew_bytes`` at its peak."""
        if grew_bytes > 0:
            each = grew_bytes / sequences
            self.per_sequence_bytes = each if self.per_sequence_bytes is None else max(self.per_sequence_bytes, each)

    def ran_out(self, error: BaseException, free_bytes: float) -> None:
        """An out-of-memory error at the current size with ``free_bytes`` free before it: half of
        the size next (the error again at one)."""
        assert self.size is not None
        if self.size <= 1:
            raise error
        self.per_sequence_bytes = max(self.per_sequence_bytes or 0.0, free_bytes / self.size)
        self.ran_out_at = self.size if self.ran_out_at is None else min(self.ran_out_at, self.size)
        self.retry = True
        log.warning("generation ran out of memory at %d sequences at once; trying %d", self.size, self.size // 2)
        self._set(self.size // 2)

    def _set(self, size: int) -> None:
        if size != self.size:
            self.size = size
            self.sizes.append((time.time(), size))


def generate_in_chunks(
    engine: GenerationEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    batch: GenerationBatch,
    memory: MemoryProbe,
    should_stop: Callable[[], bool] = never,
) -> list[Completion] | None:
    """``engine.generate`` of ``prompts``, in chunks ``batch`` sizes (module docstring), each one's
    memory measured by ``memory``; None if ``should_stop()`` turned True meanwhile."""
    completions: list[Completion] = []
    batch.at_once = 0
    while len(completions) < len(prompts):
        pending = len(prompts) - len(completions)
        free = memory.free()
        chunk = prompts[len(completions) : len(completions) + batch.next_size(pending, free)]
        before = memory.start()
        try:
            done = engine.generate(chunk, params, should_stop=should_stop)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            batch.ran_out(e, free)
            continue
        if done is None:
            return None
        batch.measured(len(chunk), memory.peak() - before)
        batch.at_once = max(batch.at_once, len(chunk))
        completions += done
    return completions
