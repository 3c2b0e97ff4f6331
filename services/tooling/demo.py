"""``spotrl demo``: the whole loop on this machine, watched live, ending with the bill.

It starts the API and scheduler (embedded backends) on a free loopback port, submits a GRPO
run over HTTP on small arithmetic with an exact-match reward, shows progress with Rich, and
prints the cost report: what the run spent against an always-on on-demand cluster. The live
view and the bill are ``spotrl runs watch`` and ``spotrl runs cost``'s (``services.client.view``).

With ``chaos`` (``spotrl demo --chaos``) the scheduler runs as its own process and
``services.tooling.chaos.Chaos`` SIGKILLs rollout workers, a training job between publishing its
policy and committing its samples, and the scheduler itself (restarting it) during the run;
the demo then prints what was done and the audit of the run (``services.tooling.run_audit.audit_run``), and
succeeds only if the run did and the audit found nothing wrong.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from rich.console import Console

from contracts.model_sources import BUILTIN_MODELS
from services.client.view import cost_table, watch_run
from services.control.api.main import create_app
from services.core.config import Settings
from services.ports.wiring import open_backends
from services.tooling.arithmetic import arithmetic_prompts
from services.tooling.chaos import Chaos
from services.tooling.chaos_plan import ChaosPlan, ChaosTally
from services.tooling.run_audit import Audit, audit_run
from trainer_core.models.loading import load_policy


def demo_spec(model: str, iterations: int | None = None, training_capacity: str = "on-demand") -> dict[str, Any]:
    """Sized to finish in minutes on 2 CPU cores: the real defaults (5000-sample batches) are for GPUs.
    ``iterations`` (``spotrl demo --iterations``) replaces the model's default number of iterations;
    ``training_capacity``: the training jobs' (spot under chaos, which preempts them)."""
    tiny = model == "tiny"
    return {
        "name": "demo-arithmetic",
        "model": model,
        "algorithm": "grpo",
        # One batch of fixed problems, so the mean reward of each iteration is comparable.
        "prompts": arithmetic_prompts(16 if not tiny else 8),
        "reward": [{"fn": "exact_match"}],
        "samples_per_prompt": 4,
        # 0.7: at 1.0 the 135M model mostly rambles; at 0.7 about a quarter of its answers are right.
        "sampling": {"temperature": 0.7, "max_new_tokens": 16 if tiny else 32},
        "batch_samples": 32 if tiny else 64,
        "iterations": iterations or (3 if tiny else 5),
        # On 2 CPU cores one worker and the training job keep both busy; on GPUs, raise max_workers.
        "rollout": {
            "instance_type": "g6.xlarge",
            "spot": True,
            "min_workers": 1,
            "max_workers": 1,
            "prompts_per_batch": 8,
        },
        "training": {
            "instance_type": "p4d.24xlarge",
            "learning_rate": 1e-4 if tiny else 2e-5,
            "mini_batch": 16,
            "micro_batch": 8,
            "capacity": training_capacity,
        },
        "staleness_bound": 1,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the demo's own process handles Ctrl-C
        pass


def chaos_settings(settings: Settings, model: str) -> Settings:
    """Settings under which a chaos run recovers in seconds, not minutes: a dead scheduler's
    lease and a dead worker's prompts pass on quickly (a worker's batch must still fit in its
    session: a few seconds on the tiny model, tens on SmolLM2 on CPUs)."""
    return settings.model_copy(
        update={
            "lease_seconds": min(settings.lease_seconds, 3.0),
            "session_timeout_s": min(settings.session_timeout_s, 10.0 if model == "tiny" else 30.0),
            "stop_grace_s": min(settings.stop_grace_s, 10.0),
        }
    )


def run_demo(
    *,
    model: str,
    settings: Settings,
    summary_json: Path | None,
    console: Console | None = None,
    chaos: ChaosPlan | None = None,
    iterations: int | None = None,
) -> bool:
    console = console or Console()
    if chaos is not None:
        settings = chaos_settings(settings, model)
    if model not in BUILTIN_MODELS:
        # The demo's user names a model on this machine: the demo's own API allows its directory.
        model = str(Path(model).expanduser().resolve())
        settings = settings.model_copy(
            update={"data_dirs": os.pathsep.join(filter(None, [settings.data_dirs, str(Path(model).parent)]))}
        )
    settings.home.mkdir(parents=True, exist_ok=True)
    # A .gguf is dequantised once (~25 s); doing it here keeps the pods from all doing it at once.
    with console.status(f"preparing {model} (cached after the first demo)"):
        load_policy(model, cache_dir=settings.resolved_model_cache())
    port = _free_port()
    # Under chaos the scheduler is a process of its own, which the monkey kills and restarts.
    app = create_app(settings, with_scheduler=chaos is None)
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not server.started:
                time.sleep(0.05)
            capacity = "spot" if chaos is not None and chaos.training_preemptions else "on-demand"
            response = client.post("/v1/runs", json=demo_spec(model, iterations, capacity))
            response.raise_for_status()
            run = response.json()
            console.print(f"submitted {run['id']} ({model}); state in {settings.home}")
            if chaos is None:
                run = _watch(client, run, console)
            else:
                backends = open_backends(settings)
                try:
                    with Chaos(settings, backends, run["id"], chaos, log_dir=settings.home / "chaos") as monkey:
                        run = _watch(client, run, console)
                    tally, audit = monkey.tally, audit_run(backends, run["id"])
                finally:
                    backends.close()
            cost = client.get(f"/v1/runs/{run['id']}/cost").json()
    finally:
        server.should_exit = True
        thread.join(timeout=60)

    audited = (tally, audit) if chaos is not None else None
    _report(console, run, cost, audited, summary_json)
    return run["status"] == "SUCCEEDED" and (chaos is None or audit.ok)


def _report(
    console: Console,
    run: dict[str, Any],
    cost: dict[str, Any],
    audited: tuple[ChaosTally, Audit] | None,
    summary_json: Path | None,
) -> None:
    """Print how the run went (and, under chaos, what was done to it and its audit); write the summary file."""
    console.print()
    console.print(f"run {run['id']} {run['status']}: {run['status_reason']}")
    rewards = [it["mean_reward"] for it in run["iterations"]]
    console.print("mean reward per iteration: " + " -> ".join(f"{r:.3f}" for r in rewards))
    console.print(cost_table(cost))
    if audited is not None:
        tally, audit = audited
        console.print(tally.line())
        for line in audit.lines():
            console.print(line, style="bold red" if line.startswith("PROBLEM") else None, markup=False)
        console.print("audit: every guarantee held" if audit.ok else "audit: guarantees broken (above)")
    if summary_json is not None:
        summary = {
            "run_id": run["id"],
            "status": run["status"],
            "iterations": [
                {"iteration": it["iteration"], "mean_reward": it["mean_reward"], "samples": it["samples_trained"]}
                for it in run["iterations"]
            ],
            "cost": {"total_dollars": cost["total_dollars"], "always_on_dollars": cost["always_on_dollars"]},
        }
        if audited is not None:
            summary["chaos"] = _chaos_summary(*audited)
        summary_json.write_text(json.dumps(summary, indent=2))


def _watch(client: httpx.Client, run: dict[str, Any], console: Console) -> dict[str, Any]:
    """Show the run live until it ends; on Ctrl-C, cancel it and show it stopping."""

    def cancel(_: dict[str, Any]) -> None:
        # Pods outlive the scheduler: cancel, so that none is left running (or billed).
        console.print("interrupted: cancelling the run and stopping its pods ...")
        client.post(f"/v1/runs/{run['id']}/cancel")

    return watch_run(lambda: client.get(f"/v1/runs/{run['id']}").json(), run, console=console, on_interrupt=cancel)


def _chaos_summary(tally: ChaosTally, audit: Audit) -> dict[str, Any]:
    return {
        "worker_kills": len(tally.worker_kills),
        "training_kills_between_publish_and_commit": tally.training_kills,
        "training_preemptions_mid_update": [{"iteration": i, "how": how} for i, how in tally.training_preemptions],
        "scheduler_kills": tally.scheduler_kills,
        "scheduler_stops": tally.scheduler_stops,
        "samples": {"produced": audit.produced, "trained": audit.trained, "dropped": audit.dropped},
        "policy_versions": audit.policy_versions,
        "ledger": {"entries": audit.ledger_entries, "open": audit.open_entries},
        "problems": audit.problems,
    }
