"""A training job of 2 processes (torchrun, gloo on CPU), started with the command the scheduler
gives a training pod (on one machine, or one process on each of 2 nodes of an embedded pod),
against the same job in one process: two iterations on the same batches,
with a KL term to the base model (sharded too under FSDP2), must publish the same policy. The
second iteration starts from the optimizer state the first saved, so this also checks that the
sharded state is written whole and read back.

AdamW's first steps are about lr * sign(g) whatever the gradient's scale, so the gradient's
scale is checked through `actor/grad_norm` and its direction through the weights, within 2% of
one step (as in tests/trainer_core/rl/test_distributed.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from contracts.job_result import JobResult
from contracts.samples import Sample, encode_group
from services.core.config import Settings
from services.data.policy_store import fetch_policy
from services.data.training.job import run_training_job
from services.data.training.selection import even_shares
from services.domain.names import result_key, samples_topic
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodPhase, PodSpec, cli_command
from services.ports.launcher.local_launcher import LocalLauncher
from services.ports.wiring import Backends, open_backends
from trainer_core.models.loading import load_policy

REPO = Path(__file__).resolve().parents[4]
LR = 1e-3
ITERATIONS = 2
GROUPS, GROUP_SIZE = 4, 4


def spec(**training) -> RunSpec:
    return RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "x"}],
            "samples_per_prompt": GROUP_SIZE,
            "batch_samples": GROUPS * GROUP_SIZE,
            "iterations": ITERATIONS,
            "training": {"learning_rate": LR, "micro_batch": 4, "kl_coef": 0.05} | training,
        }
    )


def batch(run_id: str, iteration: int) -> list[Sample]:
    """The same samples for every run: 4 groups of 4 on prompts of different lengths."""
    gen = torch.Generator().manual_seed(iteration)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 99, (3 + g,), generator=gen).tolist()
        for k in range(GROUP_SIZE):
            n = 2 + int(torch.randint(0, 6, (), generator=gen))
            samples.append(
                Sample(
                    sample_id=f"{iteration}-{g}-{k}",
                    run_id=run_id,
                    prompt_id=str(g),
                    group_id=f"{iteration}-{g}",
                    prompt_ids=prompt,
                    response_ids=torch.randint(3, 99, (n,), generator=gen).tolist(),
                    logprobs=[-4.6] * n,
                    reward=float(k % 2 + g),
                    reward_source="rule",
                    policy_version=iteration - 1,
                    worker_id="w",
                    generation_seconds=0.0,
                    created_at=float(iteration),
                )
            )
    return samples


def produce(backends: Backends, run_id: str, iteration: int) -> None:
    for group_id, group in itertools.groupby(batch(run_id, iteration), key=lambda s: s.group_id):
        backends.queue.produce(samples_topic(run_id), [encode_group(list(group))], keys=[group_id.encode()])


def open_world(home: Path, run_id: str, run_spec: RunSpec, model_cache: Path) -> tuple[Settings, Backends]:
    settings = Settings(home=home, model_cache=model_cache)
    backends = open_backends(settings)
    backends.state.create_run(run_id, name=None, spec=run_spec.model_dump(mode="json"))
    backends.queue.create_topic(samples_topic(run_id), 2)
    return settings, backends


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.getbasetemp() / "models"  # shared with the other tests of a session
    load_policy("tiny", cache_dir=cache)  # built once here, not by both ranks at once
    return cache


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, model_cache: Path):
    """The one-process run of a spec (full fine-tuning, or with `lora_rank`), run on first use."""
    runs: dict[int, tuple[Backends, str]] = {}

    def get(lora_rank: int) -> tuple[Backends, str]:
        if lora_rank not in runs:
            run_id, run_spec = f"run-one-process-{lora_rank}", spec(lora_rank=lora_rank)
            _, backends = open_world(tmp_path_factory.mktemp("one"), run_id, run_spec, model_cache)
            for iteration in range(1, ITERATIONS + 1):
                produce(backends, run_id, iteration)
                run_training_job(
                    run_id=run_id,
                    iteration=iteration,
                    spec=run_spec,
                    queue=backends.queue,
                    objects=backends.objects,
                    model_cache=model_cache,
                )
            runs[lora_rank] = backends, run_id
        return runs[lora_rank]

    return get


def _pod_env(settings: Settings) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that crashes (an intermittent SIGABRT has been seen) prints the
    # Python stack of each of its threads.
    env = dict(os.environ, **settings.pod_env(), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # DeepSpeed's C++ ops (CPU Adam) are built once into the virtual environment by `make setup`.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return env


def _run_pods(settings: Settings, backends: Backends, run_id: str, processes: int) -> None:
    env = _pod_env(settings)
    for iteration in range(1, ITERATIONS + 1):
        produce(backends, run_id, iteration)
        command = cli_command(["train-job", run_id, str(iteration)], processes=processes)
        run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        output = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "Loading weights" not in line)
        assert run.returncode == 0, f"iteration {iteration} failed:\n{output[-8000:]}"


@pytest.mark.parametrize(
    "training",
    [
        {"strategy": "fsdp2"},
        {"strategy": "fsdp2", "lora_rank": 4},
        {"strategy": "fsdp2", "micro_batch": 0},  # sized on each rank, the least taken
        {"strategy": "zero2", "offload_optimizer": True},
        {"strategy": "zero3", "offload_optimizer": True},
    ],
    ids=["fsdp2", "fsdp2-lora", "fsdp2-auto-micro-batch", "zero2-offload", "zero3-offload"],
)
def test_a_two_process_job_publishes_what_one_process_does(
    tmp_path: Path, model_cache: Path, one_process, training: dict
) -> None:
    if training["strategy"].startswith("zero"):  # the test extra installs DeepSpeed: fail, never skip
        assert importlib.util.find_spec("deepspeed"), "DeepSpeed is missing: pip install -e '.[test]' installs it"
    run_spec = spec(processes=2, **training)
    run_id = f"run-{training['strategy']}-{run_spec.training.lora_rank}-{run_spec.training.micro_batch}"
    settings, backends = open_world(tmp_path, run_id, run_spec, model_cache)
    _run_pods(settings, backends, run_id, processes=2)
    _assert_published_as_one_process(backends, run_id, run_spec, one_process, model_cache)
    backends.close()


def test_a_job_of_two_nodes_publishes_what_one_process_does(tmp_path: Path, model_cache: Path, one_process) -> None:
    """One process on each of 2 nodes of an embedded pod, meeting at node 0 as a multi-node pod's
    do, trains as the 2 processes of one machine do (the test above): as one process."""
    run_spec = spec(processes=1, nodes=2)
    run_id = "run-two-nodes"
    settings, backends = open_world(tmp_path, run_id, run_spec, model_cache)
    launcher = LocalLauncher(tmp_path / "pods")
    for iteration in range(1, ITERATIONS + 1):
        produce(backends, run_id, iteration)
        name = f"{run_id}-train-{iteration}"
        launcher.launch(
            PodSpec(
                name=name,
                run_id=run_id,
                role="training",
                command=cli_command(["train-job", run_id, str(iteration)], nodes=2),
                env=_pod_env(settings),
                instance_type="cpu",
                capacity_type="on-demand",
                nodes=2,
            )
        )
        deadline = time.monotonic() + 900
        while (pod := launcher.list(run_id)[-1]).phase == PodPhase.RUNNING and time.monotonic() < deadline:
            time.sleep(0.5)
        log = launcher.logs(name, tail=200)
        assert (pod.phase, pod.nodes) == (PodPhase.SUCCEEDED, 2), f"iteration {iteration}:\n{log}"
    _assert_published_as_one_process(backends, run_id, run_spec, one_process, model_cache)
    backends.close()


def _assert_published_as_one_process(
    backends: Backends, run_id: str, run_spec: RunSpec, one_process, model_cache: Path
) -> None:
    want_backends, want_run = one_process(run_spec.training.lora_rank)
    for iteration in range(1, ITERATIONS + 1):
        got = JobResult.from_json(backends.objects.get_bytes(result_key(run_id, iteration)))
        want = JobResult.from_json(want_backends.objects.get_bytes(result_key(want_run, iteration)))
        assert got.trained_ids == want.trained_ids and got.dropped.uneven == []
        assert got.offsets == want.offsets
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_ref", "reward/mean", "perf/tokens"):
            assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-6), key

    def weights(b: Backends, run: str, version: int) -> dict[str, torch.Tensor]:
        return fetch_policy(b.objects, run, version, base_model="tiny", model_cache=model_cache).model.state_dict()

    initial, want, got = weights(backends, run_id, 0), weights(want_backends, want_run, 2), weights(backends, run_id, 2)
    assert got.keys() == want.keys()
    for name, value in want.items():
        if run_spec.training.lora_rank == 0:
            assert (value - initial[name]).abs().max() > LR, f"{name} did not move by about two steps"
        torch.testing.assert_close(got[name], value, atol=0.02 * LR, rtol=0, msg=name)
    if run_spec.training.lora_rank:  # the adapter trained (B starts at zero), the base did not
        assert all(want[n].abs().max() > LR for n in want if "lora_B" in n)
        assert all(
            torch.equal(want[n], initial[n.removeprefix("base_model.model.").replace(".base_layer", "")])
            for n in want
            if "lora_" not in n
        )


def test_even_shares_leave_out_trailing_groups_until_every_rank_has_as_many() -> None:
    samples = batch("run", 1)[:-2]  # groups of 4, 4, 4 and 2
    kept, left_out = even_shares(samples, world_size=2)
    assert [s.sample_id for s in kept] == [s.sample_id for s in samples[:8]]
    assert left_out == [s.sample_id for s in samples[8:]]
    assert even_shares(samples[:8], world_size=2) == (samples[:8], [])


def test_a_training_pod_of_several_processes_runs_under_torchrun() -> None:
    assert cli_command(["train-job", "r", "3"], python="py") == ["py", "-m", "services.cli.main", "train-job", "r", "3"]
    assert cli_command(["train-job", "r", "3"], processes=8, python="py") == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=8",
        "--shutdown-timeout=3600",  # ranks checkpoint at a SIGTERM: the pod's grace decides, not torchrun's 30 s
        "-m",
        "services.cli.main",
        "train-job",
        "r",
        "3",
    ]
