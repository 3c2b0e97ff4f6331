"""What the reward tests share: a small trained reward model, and the reward service served on a
free loopback port, in this process (``serve``) or as `spotrl reward-server` (``reward_server``)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from tests.servers.process import free_port
from trainer_core.supervised.reward_model import RewardModelConfig, run_train_rm


def train_reward_model(tmp: Path, model_cache: Path) -> Path:
    """A reward model on the tiny backbone that prefers replies saying "yes" to "no", in ``tmp/rm``."""
    rng = random.Random(0)
    words = ["cat", "dog", "sun", "tree", "blue", "red"]
    lines = []
    for _ in range(32):
        filler = rng.choice(words)
        lines.append({"prompt": f"{rng.choice(words)}?", "chosen": f"{filler} yes", "rejected": f"{filler} no"})
    data = tmp / "prefs.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = RewardModelConfig(learning_rate=1e-3, epochs=2, batch_size=8, max_len=64)
    run_train_rm("tiny", data, tmp / "rm", cfg, cache_dir=model_cache)
    return tmp / "rm"


def serve(app) -> Iterator[str]:  # noqa: ANN001
    """``app`` served by uvicorn in a thread on a free loopback port: its URL, then stopped."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the reward service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@contextmanager
def reward_server(*args: str) -> Iterator[tuple[subprocess.Popen, str, dict]]:
    """`spotrl reward-server ARGS` on a free loopback port: the process, its URL and its /healthz
    once it answers; interrupted (Ctrl-C) at the end, its output then in ``proc.stdout``."""
    port = free_port()
    command = [sys.executable, "-m", "services.cli.main", "reward-server", *args, "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "spotrl reward-server did not start"
            try:
                health = httpx.get(f"{url}/healthz").json()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield proc, url, health
    finally:
        proc.send_signal(2)  # SIGINT: uvicorn's clean stop
        proc.communicate(timeout=30)
