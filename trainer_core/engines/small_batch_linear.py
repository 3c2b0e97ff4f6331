"""A CPU kernel for the products of decoding: `x @ W^T` for a few rows of x, fp32.

Each decode step multiplies one row per sequence by every weight matrix, so its cost is reading
the weights from memory. For 8 rows, MKL's sgemm reads SmolLM2-135M's weights at ~9 GB/s on
the 2-core AVX2 machines this project is developed on, against ~29 GB/s for a plain read of the
same bytes; `small_batch_linear.c` reads each weight row once and multiplies it into every row
while they sit in L1, at ~20 GB/s (~22 ms against ~47 ms for the decoder layers' products of one
decode step).

The kernel is compiled with the system C compiler (`$CC`, else `cc`) on first use and cached
under `~/.cache/spotrl` (or `$XDG_CACHE_HOME/spotrl`). Without a compiler, or on a CPU without
AVX2 and FMA, `kernel()` is None and everything runs on torch as before. It uses the same
OpenMP runtime as torch (libgomp, already loaded), with torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Rows up to which the kernel runs. For a 1536 x 576 weight on the development machines it
# beats MKL by 2.3x at 8 rows, 1.3x at 32 and 1.1x at 48; at 64 they are even.
MAX_ROWS = 32
_SOURCE = Path(__file__).with_name("small_batch_linear.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def kernel() -> Callable[..., None] | None:
    """The compiled `small_batch_linear` C function, or None (with the reason logged once)
    where it cannot be built or run here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("small-batch CPU kernel off: this CPU lacks AVX2/FMA; decoding uses torch's products")
        return None
    try:
        library = ctypes.CDLL(str(_compiled()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning(
            "small-batch CPU kernel off (%s); decoding uses torch's slower products. "
            "Install a C compiler with OpenMP (gcc) or set $CC to one.",
            detail,
        )
        return None
    function = library.small_batch_linear
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    function.restype = None
    return function


def _compiled() -> Path:
    """The kernel's shared library, built into the cache on first use (atomically: concurrent
    processes may build it at once)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError(f"no C compiler {os.environ.get('CC', 'cc')!r} on PATH")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spotrl"
    library = cache / f"small_batch_linear-{digest}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as build:
            built = Path(build) / library.name
            subprocess.run(
                [compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], check=True, capture_output=True, text=True
            )
            built.replace(library)
    return library


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` can run here: `x` `(rows, in)` with at most MAX_ROWS rows,
    both fp32 on CPU, `weight` contiguous, no gradient wanted and no autocast asked for."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and _weight_fits(weight)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")
        and kernel() is not None
    )


def _weight_fits(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the kernel: x `(rows, in)`, weight `(out, in)` ->
    `(rows, out)`. Only where `fits(x, weight)`."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    kernel()(x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, weight.shape[0], torch.get_num_threads())
    return out if bias is None else out.add_(bias)


@contextmanager
def decoding_linears(model: nn.Module) -> Iterator[None]:
    """Within the block, each `nn.Linear` of `model` with fp32 CPU weights runs small batches of
    fp32 rows through the kernel (anything else through `F.linear` as usual).

    Made for a decode loop, it decides once, on entry, so that each of the loop's thousands of
    products pays for one row count check only: under autograd or autocast it changes nothing.
    The modules' own forward comes back on exit; a module whose forward is already replaced (by
    accelerate hooks, say) is left alone.
    """
    patched = [
        m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m) and _weight_fits(m.weight)
    ]
    # A model on a GPU has nothing to patch, and never builds the kernel.
    if not patched or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or kernel() is None:
        patched = []
    for module in patched:
        module.forward = functools.partial(_forward, module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows <= MAX_ROWS and x.dtype == torch.float32:
        return linear(x.reshape(rows, -1), module.weight, module.bias).view(*x.shape[:-1], -1)
    return F.linear(x, module.weight, module.bias)
