"""Launching a test's worker script as torchrun ranks on CPU (gloo), as a training pod runs them.

``run_ranks(script, args)`` starts ``processes`` ranks of ``script`` under
``torch.distributed.run --standalone`` from the repository root (with ``nodes`` > 1, one torchrun
of ``processes`` ranks per "node", meeting at node 0 as a multi-node pod's do), with the repository importable,
one OpenMP thread a rank (two ranks share two cores) and each rank's Python stack printed if it
crashes (an intermittent SIGABRT has been seen). ``output(run)`` is what the ranks printed,
without the model loader's progress lines, to put in an assertion's message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.ports.launcher.launcher import cli_command
from services.ports.launcher.local_pod import node_envs

REPO = Path(__file__).resolve().parents[1]


def run_ranks(
    script: Path,
    args: list[str],
    *,
    processes: int = 2,
    nodes: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 1500,
) -> subprocess.CompletedProcess[str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    rank_env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, PYTHONFAULTHANDLER="1")
    # DeepSpeed JIT-builds its C++ ops (CPU Adam, shared-memory comm) on first use, minutes on
    # 2 cores: cached with the virtual environment, so later runs load them in a second.
    rank_env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if nodes == 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        return subprocess.run(
            [*command, str(script), *args], env=rank_env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
    command = [*cli_command([], processes=processes, nodes=nodes)[:-2], str(script), *args]
    runs = [
        subprocess.Popen(
            command, env=rank_env | node, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for node in node_envs(nodes)
    ]
    outputs = [run.communicate(timeout=timeout)[0] for run in runs]
    failed = next((run.returncode for run in runs if run.returncode), 0)
    return subprocess.CompletedProcess(command, failed, "".join(outputs), "")


def output(run: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "Loading weights" not in line)
