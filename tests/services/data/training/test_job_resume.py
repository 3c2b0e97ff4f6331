"""A spot training job stopped within its update, and the iteration's next job (the scheduler's
retry, the same name), against the embedded queue and object store, on the tiny model.

The retry must train the batch the stopped job took, resume its update from the last complete
checkpoint, publish the policy an uninterrupted job publishes from that batch, and commit the
same offsets: each sample is trained exactly once. The update takes 4 optimizer steps (2 epochs of
2 shuffled mini-batches of one group each).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from contracts.job_result import JobResult
from contracts.samples import Sample, encode_group
from services.data.policy_store import fetch_policy
from services.data.training import job as training_job
from services.data.training import update_checkpoint
from services.data.training.job import run_training_job
from services.data.training.update_checkpoint import Preempted, UpdateCheckpointStore
from services.domain.names import (
    TRAINER_GROUP,
    policy_prefix,
    result_key,
    samples_topic,
    update_checkpoint_prefix,
)
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import EXIT_PREEMPTED
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectStore, folder_key
from services.ports.queue.sqlite_queue import SqliteQueue
from tests.services.data.training.test_job import RUN, spec
from tests.torchrun import output, run_ranks
from trainer_core.models.loading import load_policy

STEPS = 4
PARTIAL = update_checkpoint_prefix(RUN, 1)
# Metrics of the job's own run, not of what it trained.
OWN_METRICS = {"perf/seconds", "perf/tokens_per_s", "perf/memory_bytes", "perf/peak_memory_bytes"}


def training(capacity: str) -> RunSpec:
    return spec(training={"capacity": capacity, "epochs": 2, "mini_batch": 4, "learning_rate": 1e-2, "kl_coef": 0.05})


def produce(queue: SqliteQueue, groups: range, version: int = 0) -> list[str]:
    """Groups of 4 samples with the same ids and contents in every test's queue."""
    ids = []
    for g in groups:
        samples = [
            Sample(
                sample_id=f"s{g}-{k}",
                run_id=RUN,
                prompt_id=str(g),
                group_id=f"g{g}",
                prompt_ids=[5, 6, 7 + g],
                response_ids=[8, 9, 10 + k],
                logprobs=[-4.0, -4.5, -4.0],
                reward=float(k % 2) + 0.1 * g,
                reward_source="rule",
                policy_version=version,
                worker_id="w",
                generation_seconds=0.0,
                created_at=0.0,
            )
            for k in range(4)
        ]
        queue.produce(samples_topic(RUN), [encode_group(samples)], keys=[f"g{g}".encode()])
        ids += [s.sample_id for s in samples]
    return ids


class World:
    """One run's queue, object store and model cache."""

    def __init__(self, root: Path, model_cache: Path) -> None:
        self.queue = SqliteQueue(root / "queue.db")
        self.queue.create_topic(samples_topic(RUN), 2)
        self.objects = LocalObjectStore(root / "objects")
        self.models = model_cache

    def job(
        self, run_spec: RunSpec, iteration: int = 1, objects: ObjectStore | None = None, on_spot: bool = True
    ) -> JobResult | None:
        return run_training_job(
            run_id=RUN,
            iteration=iteration,
            spec=run_spec,
            queue=self.queue,
            objects=objects or self.objects,
            model_cache=self.models,
            on_spot=on_spot,
        )

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        policy = fetch_policy(self.objects, RUN, version, base_model="tiny", model_cache=self.models)
        return policy.model.state_dict()

    def manifest(self) -> dict:
        return json.loads(self.objects.get_bytes(PARTIAL + "manifest.json"))

    def backlog(self) -> int:
        return self.queue.backlog(samples_topic(RUN), TRAINER_GROUP)


@pytest.fixture
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "models"  # the tiny model, built once per session


@pytest.fixture
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> tuple[World, JobResult]:
    """An on-demand job of iteration 1 on the first 2 groups: what every stopped job's retry must equal."""
    world = World(tmp_path_factory.mktemp("uninterrupted"), model_cache)
    produce(world.queue, range(2))
    result = world.job(training("on-demand"))
    assert not world.objects.list(update_checkpoint_prefix(RUN, 1)), "an on-demand job keeps no checkpoint"
    return world, result


@pytest.fixture
def world(tmp_path: Path, model_cache: Path):
    w = World(tmp_path, model_cache)
    yield w
    w.queue.close()


def at_step(
    monkeypatch: pytest.MonkeyPatch, method: str, step: int, action: Callable[[], None], before: bool = False
) -> None:
    """Run `action` in UpdateCheckpointStore.<method>(steps) at `step`: before the call or after it."""
    original = getattr(UpdateCheckpointStore, method)

    def wrapped(self, steps: int, *args):
        if before and steps == step:
            action()
        out = original(self, steps, *args)
        if not before and steps == step:
            action()
        return out

    monkeypatch.setattr(UpdateCheckpointStore, method, wrapped)


def every_step_is_due(monkeypatch: pytest.MonkeyPatch, every_s: float = 300.0) -> None:
    """A clock that moves `every_s` each time it is read: every step is a periodic checkpoint's."""
    now = iter(range(0, 10**9, int(every_s)))
    monkeypatch.setattr(update_checkpoint, "monotonic", lambda: float(next(now)))


class Clock:
    """A clock that moves only when the test moves it, the update checkpoint's and the job's alike."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(update_checkpoint, "monotonic", lambda: self.now)
        monkeypatch.setattr(training_job, "time", SimpleNamespace(time=lambda: self.now))

    def advance(self, seconds: float) -> Callable[[], None]:
        def move() -> None:
            self.now += seconds

        return move


class Killed(Exception):
    """The job's process ended there, without notice."""


def kill() -> None:
    raise Killed


def assert_same_iteration(got: JobResult, got_world: World, want: JobResult, want_world: World) -> None:
    """The retry published what the uninterrupted job did, from the same samples, and committed alike."""
    assert got.trained_ids == want.trained_ids and got.samples_read == want.samples_read
    assert got.offsets == want.offsets
    assert {k: v for k, v in got.metrics.items() if k not in OWN_METRICS} == {
        k: v for k, v in want.metrics.items() if k not in OWN_METRICS
    }
    got_weights, want_weights = got_world.weights(1), want_world.weights(1)
    assert got_weights.keys() == want_weights.keys()
    for name, weight in want_weights.items():
        assert torch.equal(got_weights[name], weight), name
    assert not got_world.objects.list(PARTIAL), "the published iteration's checkpoint is deleted"


@pytest.mark.parametrize("notice_at", [2, 0], ids=["notice-after-step-2", "notice-before-the-update"])
def test_a_job_stopped_by_the_notice_resumes_and_publishes_what_an_uninterrupted_one_does(
    world: World, uninterrupted, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, notice_at: int
) -> None:
    want_world, want = uninterrupted
    produce(world.queue, range(2))
    notice = lambda: os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731 -- as Kubernetes gives a spot node's notice
    if notice_at:
        at_step(monkeypatch, "due", notice_at, notice, before=True)
    else:  # while the job loads its models, after it took its batch
        monkeypatch.setattr(UpdateCheckpointStore, "stop_if_noticed", _noticed(UpdateCheckpointStore.stop_if_noticed))
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        world.job(training("spot"))
    assert stopped.value.code == EXIT_PREEMPTED and stopped.value.steps == notice_at
    assert signal.getsignal(signal.SIGTERM) is handler, "the job's handler is gone with it"
    assert not world.objects.exists(result_key(RUN, 1)) and not world.objects.list(policy_prefix(RUN, 1))
    assert world.backlog() == 2, "nothing committed"
    assert world.objects.exists(PARTIAL + "batch.json")
    if notice_at:
        assert world.manifest()["steps"] == notice_at
    else:
        assert not world.objects.exists(PARTIAL + "manifest.json")
    monkeypatch.undo()

    later = produce(world.queue, range(2, 4))  # arrived while the node was being replaced
    caplog.set_level(logging.INFO, logger=update_checkpoint.__name__)
    result = world.job(training("spot"))
    assert "the batch an earlier job took" in caplog.text
    assert (f"resuming the update after step {notice_at}" in caplog.text) == bool(notice_at)
    assert_same_iteration(result, world, want, want_world)
    assert world.backlog() == 2, "the groups that arrived since are the next iteration's"

    second = world.job(training("spot"), iteration=2)
    assert sorted(second.trained_ids) == sorted(later), "each sample trained exactly once"
    assert world.backlog() == 0


def test_a_notice_during_the_last_step_lets_the_job_publish(
    world: World, uninterrupted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the update's last step no checkpoint is taken, notice or not: the job publishes, and
    no retry has to load the update's end only to publish it."""
    want_world, want = uninterrupted
    produce(world.queue, range(2))
    at_step(monkeypatch, "due", STEPS - 1, lambda: os.kill(os.getpid(), signal.SIGTERM))  # once step 3 was asked
    result = world.job(training("spot"))  # not Preempted
    assert_same_iteration(result, world, want, want_world)
    assert world.backlog() == 0, "committed"


def _noticed(stop_if_noticed: Callable[[UpdateCheckpointStore], None]) -> Callable[[UpdateCheckpointStore], None]:
    def noticed(self: UpdateCheckpointStore) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        stop_if_noticed(self)

    return noticed


def test_a_kill_without_notice_resumes_from_the_last_periodic_checkpoint(
    world: World, uninterrupted, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    want_world, want = uninterrupted
    produce(world.queue, range(2))
    every_step_is_due(monkeypatch)
    at_step(monkeypatch, "save", 3, kill)  # killed once step 3's checkpoint is stored
    with pytest.raises(Killed):
        world.job(training("spot"))
    assert world.manifest()["steps"] == 3
    folders = {key.removeprefix(PARTIAL).split("/")[0] for key in world.objects.list(PARTIAL)}
    assert folders == {"batch.json", "manifest.json", "step-000003"}, "the checkpoints before the last are deleted"
    monkeypatch.undo()

    caplog.set_level(logging.INFO, logger=update_checkpoint.__name__)
    result = world.job(training("spot"))
    assert "resuming the update after step 3" in caplog.text
    assert_same_iteration(result, world, want, want_world)


def test_a_resumed_job_reports_the_seconds_of_the_whole_update(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each manifest records the seconds the iteration's jobs spent up to its checkpoint, and the job
    that publishes adds its own: the result's seconds (which the scheduler's estimate of a job's
    time averages) are the whole update's, not the last job's share."""
    produce(world.queue, range(2))
    every_s = training("spot").training.checkpoint_every_s
    clock = Clock(monkeypatch)
    with monkeypatch.context() as first:  # a checkpoint after step 1, once every_s went by; then killed
        at_step(first, "due", 1, clock.advance(every_s), before=True)
        at_step(first, "save", 1, kill)
        with pytest.raises(Killed):
            world.job(training("spot"))
    assert world.manifest()["steps"] == 1 and world.manifest()["seconds"] == every_s
    with monkeypatch.context() as second:  # resumed: a checkpoint after step 2, twice every_s later; killed
        at_step(second, "due", 2, clock.advance(2 * every_s), before=True)
        at_step(second, "save", 2, kill)
        with pytest.raises(Killed):
            world.job(training("spot"))
    assert world.manifest()["steps"] == 2 and world.manifest()["seconds"] == 3 * every_s
    with monkeypatch.context() as third:  # resumed: 42 s more to the end, no checkpoint due
        at_step(third, "due", 3, clock.advance(42.0), before=True)
        result = world.job(training("spot"))
    assert result.seconds == 3 * every_s + 42.0


def test_a_manifest_of_an_earlier_release_counts_no_earlier_seconds(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest written before manifests recorded their seconds: the resumed job reports its own."""
    produce(world.queue, range(2))
    clock = Clock(monkeypatch)
    with monkeypatch.context() as first:
        at_step(first, "due", 1, clock.advance(training("spot").training.checkpoint_every_s), before=True)
        at_step(first, "save", 1, kill)
        with pytest.raises(Killed):
            world.job(training("spot"))
    manifest = world.manifest()
    del manifest["seconds"]
    world.objects.put_bytes(PARTIAL + "manifest.json", json.dumps(manifest).encode())
    at_step(monkeypatch, "due", 2, clock.advance(42.0), before=True)
    assert world.job(training("spot")).seconds == 42.0


class KilledWhileUploading:
    """The object store of a job killed after the first file of the folder `doomed` was stored."""

    def __init__(self, objects: ObjectStore, doomed: str) -> None:
        self._objects, self._doomed = objects, doomed

    def __getattr__(self, name: str):
        return getattr(self._objects, name)

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        for n, path in enumerate(sorted(p for p in local_dir.rglob("*") if p.is_file())):
            if n == 1 and prefix.rstrip("/").endswith(self._doomed):
                raise Killed(f"while uploading {prefix}")
            self._objects.put_file(folder_key(prefix, path.relative_to(local_dir).as_posix()), path)


@pytest.mark.parametrize("doomed", [2, 1], ids=["second-checkpoint", "first-checkpoint"])
def test_a_kill_while_writing_a_checkpoint_leaves_the_one_before_in_force(
    world: World, uninterrupted, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, doomed: int
) -> None:
    want_world, want = uninterrupted
    produce(world.queue, range(2))
    every_step_is_due(monkeypatch)
    with pytest.raises(Killed):
        world.job(training("spot"), objects=KilledWhileUploading(world.objects, f"step-{doomed:06d}"))
    assert world.objects.list(PARTIAL + f"step-{doomed:06d}/"), "a part of the checkpoint was stored"
    if doomed > 1:
        assert world.manifest()["steps"] == doomed - 1, "the manifest still names the one before"
    else:
        assert not world.objects.exists(PARTIAL + "manifest.json")
    monkeypatch.undo()

    caplog.set_level(logging.INFO, logger=update_checkpoint.__name__)
    result = world.job(training("spot"))
    assert ("resuming the update after step 1" in caplog.text) == (doomed == 2)
    assert "resuming the update" in caplog.text or doomed == 1
    assert_same_iteration(result, world, want, want_world)


def test_an_auto_job_placed_on_demand_takes_no_checkpoint(
    world: World, uninterrupted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step would be due on spot; on-demand nothing preempts the job, and none is taken."""
    want_world, want = uninterrupted
    produce(world.queue, range(2))
    every_step_is_due(monkeypatch)
    saved = []
    monkeypatch.setattr(UpdateCheckpointStore, "save", lambda self, steps, write: saved.append(steps))
    result = world.job(training("auto"), on_spot=False)
    assert saved == []
    assert_same_iteration(result, world, want, want_world)
    produce(world.queue, range(2, 4))
    world.job(training("auto"), iteration=2)  # on spot, the same clock: a checkpoint after every step but the last
    assert saved == [1, 2, 3]


def test_an_auto_job_stores_its_batch_and_micro_batch_size_before_its_update(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Auto capacity may run on spot: it checkpoints too. What a retry trains is what the first job
    took, sample for sample, with the micro-batch size it chose (micro_batch 0: from free memory)."""
    ids = produce(world.queue, range(2))
    monkeypatch.setattr(UpdateCheckpointStore, "stop_if_noticed", _noticed(UpdateCheckpointStore.stop_if_noticed))
    auto = spec(training={"capacity": "auto", "micro_batch": 0})
    with pytest.raises(Preempted):
        world.job(auto)
    stored = update_checkpoint.StoredBatch.from_json(world.objects.get_bytes(PARTIAL + "batch.json"))
    assert [s.sample_id for s in stored.selection.kept] == ids
    ends = {p: offset for p, offset in world.queue.end_offsets(samples_topic(RUN)).items() if offset}
    assert stored.samples_read == len(ids) and stored.offsets == ends
    assert stored.micro_batch > 0, "the size auto chose"
    assert update_checkpoint.StoredBatch.from_json(stored.to_json()) == stored


@pytest.mark.parametrize("shape", [{"processes": 2}, {"processes": 1, "nodes": 2}], ids=["one-node", "two-nodes"])
def test_two_processes_stop_together_at_one_ranks_notice_and_resume(
    tmp_path: Path, model_cache: Path, shape: dict[str, int]
) -> None:
    """A 2-process FSDP2 spot job (torchrun, gloo on CPU; on one machine, or one process on each of
    2 nodes, each writing its own checkpoint parts) whose rank 1 alone gets the notice after step
    2: both ranks stop once the checkpoint is stored, and the retry publishes, bit for bit, what an
    uninterrupted job of the same shape and batch publishes."""
    from tests.services.data.training import test_job_data_parallel as dp

    load_policy("tiny", cache_dir=model_cache)  # built once here, not by both ranks at once
    run_spec = dp.spec(**shape, strategy="fsdp2", capacity="spot", epochs=2, mini_batch=8)
    worlds = {}
    for name in ("uninterrupted", "stopped"):
        run_id = f"run-{name}"
        settings, backends = dp.open_world(tmp_path / name, run_id, run_spec, model_cache)
        dp.produce(backends, run_id, 1)
        worlds[name] = settings, backends, run_id

    def launch(name: str, *notice: str) -> subprocess.CompletedProcess[str]:
        settings, _, run_id = worlds[name]
        return run_ranks(
            Path(__file__).with_name("spot_job_worker.py"),
            [run_id, "1", *notice],
            processes=shape["processes"],
            nodes=shape.get("nodes", 1),
            env=settings.pod_env(),
            timeout=600,
        )

    run = launch("uninterrupted")
    assert run.returncode == 0, output(run)[-8000:]
    stopped = launch("stopped", "--notice-rank", "1", "--notice-after", "2")
    assert stopped.returncode != 0, "torchrun reports its ranks' exits"
    assert output(stopped).count(f"exitcode  : {EXIT_PREEMPTED}") == 2, "each rank stopped, with EXIT_PREEMPTED"
    _, backends, run_id = worlds["stopped"]
    manifest = json.loads(backends.objects.get_bytes(update_checkpoint_prefix(run_id, 1) + "manifest.json"))
    assert manifest["steps"] == 2
    assert not backends.objects.exists(result_key(run_id, 1))
    retry = launch("stopped")
    assert retry.returncode == 0, output(retry)[-8000:]
    assert "resuming the update after step 2" in output(retry)

    (_, want_backends, want_run), (_, got_backends, got_run) = worlds["uninterrupted"], worlds["stopped"]
    got = JobResult.from_json(got_backends.objects.get_bytes(result_key(got_run, 1)))
    want = JobResult.from_json(want_backends.objects.get_bytes(result_key(want_run, 1)))
    assert got.trained_ids == want.trained_ids and got.offsets == want.offsets
    assert got.metrics["actor/grad_norm"] == want.metrics["actor/grad_norm"]
    got_weights, want_weights = (
        fetch_policy(b.objects, r, 1, base_model="tiny", model_cache=model_cache).model.state_dict()
        for b, r in ((got_backends, got_run), (want_backends, want_run))
    )
    for name, weight in want_weights.items():
        assert torch.equal(got_weights[name], weight), name
    assert not got_backends.objects.list(update_checkpoint_prefix(got_run, 1))
    for _, backends, _ in worlds.values():
        backends.close()
