"""A spot training job's checkpoint within its update: the next job of a preempted iteration
resumes where the preempted one got to.

A job whose ``training.capacity`` is not on-demand (spot, or auto: the scheduler may place it on
spot) keeps, under its iteration's trainer prefix (``names.trainer_prefix``):

    partial/batch.json      the batch it took, stored before its update: the samples selected (kept,
                            and the ids dropped), how many it read, the end offsets to commit, the
                            micro-batch size it chose, and an id
    partial/step-<k>/...    the update's state after k optimizer steps (``trainer_core.rl.resume``)
    partial/manifest.json   the last complete checkpoint: the batch's id, k, the folder, and the
                            seconds the iteration's jobs spent up to it, which the job that resumes
                            from it adds to its own (its result's ``seconds`` are the whole update's)

It checkpoints every ``checkpoint_every_s`` seconds of update, and at once after the provider's
preemption notice, which reaches the pod as SIGTERM at the start of its grace period (120 s on
AWS, 30 s on GCP); after that checkpoint the job exits with ``EXIT_PREEMPTED``. A kill without
notice (SIGKILL, the node gone) loses at most ``checkpoint_every_s`` of update. After the
update's last step it takes none, notice or not: the job publishes next.

A kill at any moment never leaves a checkpoint that loads wrong: ``batch.json`` is one object
(stored whole or not at all); a checkpoint's files go into a folder of their own, then the
manifest that names it is written (one small object), and only then is the folder before it
deleted. A resumed job reads only a folder the manifest names, and only if the manifest names
the stored batch.

The iteration's next job (the same name) trains the stored batch, not what the queue holds by
then; it resumes from the manifest's checkpoint, publishes, and commits the stored offsets: no
sample is trained twice or lost. Once the iteration is published its ``partial/`` is deleted
(``job._retain``; the scheduler's rotation takes any left over with the trainer state).

With several processes the first rank of each machine moves files between the object store and
the machine's disk, which its ranks share (the leader stores the manifest once every machine has
stored its part), and every decision (a checkpoint due, a notice to stop) is the ranks' agreed one.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from time import monotonic

from contracts.job_result import DroppedSamples
from contracts.samples import decode_sample, encode_sample
from contracts.training import TrainConfig, TrainingCapacity
from services.data.training.ranks import Ranks
from services.data.training.selection import Selection
from services.domain.names import update_checkpoint_prefix
from services.ports.launcher.launcher import EXIT_PREEMPTED
from services.ports.objects.object_store import ObjectStore

log = logging.getLogger(__name__)

BATCH_FILE = "batch.json"
MANIFEST_FILE = "manifest.json"
# A job that stopped at a preemption notice with its checkpoint stored exits with the launchers'
# EXIT_PREEMPTED. Under torchrun each rank exits so, and the pod's status is torchrun's.


class Preempted(SystemExit):
    """The job stopped at a preemption notice once its checkpoint was stored. A SystemExit: left
    alone, the process ends with EXIT_PREEMPTED (the `finally` blocks run on the way)."""

    def __init__(self, steps: int) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.steps = steps


@contextmanager
def update_checkpoint(
    cfg: TrainConfig, objects: ObjectStore, run_id: str, iteration: int, local: Path, ranks: Ranks, on_spot: bool
) -> Iterator[UpdateCheckpointStore | None]:
    """While the block runs: the job's `UpdateCheckpointStore` with the preemption notice taken
    (SIGTERM), its local files under `local` (removed after); None for an on-demand run's job.

    A job of a run that may train on spot, placed on-demand (``on_spot`` False: auto chose it, or
    an earlier attempt was given up), keeps and trains its iteration's batch as on spot but takes
    no checkpoint: nothing preempts it, and a checkpoint of a large model is minutes of the dearest node."""
    if cfg.capacity == TrainingCapacity.ON_DEMAND:
        yield None
        return
    every_s = cfg.checkpoint_every_s if on_spot else math.inf
    with preemption_notice() if on_spot else nullcontext(threading.Event()) as notice:
        store = UpdateCheckpointStore(objects, run_id, iteration, local, ranks, every_s, notice)
        try:
            yield store
        finally:
            store.close()


@contextmanager
def preemption_notice() -> Iterator[threading.Event]:
    """An event set when SIGTERM arrives while the block runs (Kubernetes passes a spot node's
    notice to its pods as SIGTERM); the handler before it is put back after. Only the main thread
    can take signals: elsewhere the event is never set, and the periodic checkpoints remain."""
    notice = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: a preemption notice (SIGTERM) will not be waited for")
        yield notice
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: notice.set())
    try:
        yield notice
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class StoredBatch:
    """The batch a job took, as its iteration's later jobs train it."""

    batch_id: str
    samples_read: int
    offsets: dict[int, int]
    selection: Selection
    micro_batch: int  # the micro-batch size the job trained with (auto's choice, or the spec's)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "batch_id": self.batch_id,
                "samples_read": self.samples_read,
                "offsets": self.offsets,
                "micro_batch": self.micro_batch,
                "dropped": self.selection.dropped.model_dump(mode="json"),
                # The queue's own encoding of each sample: decoded, the same sample the first job trained.
                "kept": [base64.b64encode(encode_sample(s)).decode() for s in self.selection.kept],
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredBatch:
        raw = json.loads(data)
        selection = Selection(
            kept=[decode_sample(base64.b64decode(s)) for s in raw["kept"]],
            dropped=DroppedSamples.model_validate(raw["dropped"]),
        )
        offsets = {int(partition): offset for partition, offset in raw["offsets"].items()}
        return cls(raw["batch_id"], raw["samples_read"], offsets, selection, raw["micro_batch"])


class UpdateCheckpointStore:
    """The `trainer_core.rl.resume.UpdateCheckpoint` of a spot job (module docstring), and the
    batch it keeps. Every method is called on every rank alike (each takes collective steps)."""

    def __init__(
        self,
        objects: ObjectStore,
        run_id: str,
        iteration: int,
        local: Path,
        ranks: Ranks,
        every_s: float,
        notice: threading.Event,
    ) -> None:
        self._objects, self._ranks, self._every_s, self._notice = objects, ranks, every_s, notice
        self._iteration = iteration
        self._prefix = update_checkpoint_prefix(run_id, iteration)
        self._local = local  # on the machine's disk, shared by its ranks
        self._batch_id: str | None = None
        self._started = self._since = monotonic()
        # The seconds the iteration's earlier jobs spent up to the checkpoint this one resumes
        # from (the leader's: it stores the manifests and the result); 0 for a job that starts the update.
        self.earlier_seconds = 0.0
        self._stopping = False
        if ranks.node_leader:
            shutil.rmtree(local, ignore_errors=True)  # what an earlier job on this machine left

    def stored_batch(self) -> StoredBatch | None:
        """The batch an earlier job of the iteration stored, or None (a collective)."""
        key = self._prefix + BATCH_FILE
        stored = None
        if self._ranks.leader and self._objects.exists(key):
            stored = StoredBatch.from_json(self._objects.get_bytes(key))
            log.info(
                "iteration %d: training the batch an earlier job took (%d samples read, %d kept), not the queue's",
                self._iteration,
                stored.samples_read,
                len(stored.selection.kept),
            )
        stored = self._ranks.share(stored)
        if stored is not None:
            self._batch_id = stored.batch_id
        return stored

    def keep_batch(self, samples_read: int, offsets: dict[int, int], selection: Selection, micro_batch: int) -> None:
        """Store the batch this job took (the leader writes; the others pass anything)."""
        self._batch_id = self._ranks.share(uuid.uuid4().hex if self._ranks.leader else None)
        if self._ranks.leader:
            batch = StoredBatch(self._batch_id, samples_read, offsets, selection, micro_batch)
            self._objects.put_bytes(self._prefix + BATCH_FILE, batch.to_json())

    def stop_if_noticed(self) -> None:
        """Exit (`Preempted`) if a preemption notice came before the update started: its batch is
        stored, and no step is lost."""
        if self._ranks.least(0 if self._notice.is_set() else 1) == 0:
            log.warning("iteration %d: preemption notice before the update; its batch is stored", self._iteration)
            raise Preempted(0)

    # --- trainer_core.rl.resume.UpdateCheckpoint ---------------------------------------------

    def restore(self) -> Path | None:
        folder = self._ranks.share(self._latest_folder() if self._ranks.leader else None)
        directory = None
        if folder is not None:
            directory = self._local / "resume"
            if self._ranks.node_leader:
                shutil.rmtree(directory, ignore_errors=True)
                self._objects.download_dir(self._prefix + folder, directory)
            self._ranks.share(None)  # on every machine's disk
        self._since = monotonic()  # the update's seconds start now
        return directory

    def due(self, steps: int) -> bool:
        # 0: a notice came (checkpoint, then stop); 1: a periodic checkpoint; 2: none. The least
        # over the ranks: a notice on any rank, or the interval up on any, is every rank's.
        want = 0 if self._notice.is_set() else 1 if monotonic() - self._since >= self._every_s else 2
        agreed = self._ranks.least(want)
        self._stopping = agreed == 0
        return agreed < 2

    def save(self, steps: int, write: Callable[[Path], None]) -> None:
        started = monotonic()
        folder = f"step-{steps:06d}/"
        local = self._local / folder
        if self._ranks.leader:  # a part a killed job left of the same step
            self._objects.delete_prefix(self._prefix + folder)
        write(local)
        self._ranks.share(None)  # every rank's part is written
        if self._ranks.node_leader and not self._ranks.leader:  # another machine's parts
            self._objects.upload_dir(local, self._prefix + folder)
            shutil.rmtree(local)
        self._ranks.share(None)  # every other machine's parts are stored
        if self._ranks.leader:
            self._store(local, folder, steps)
            log.info(
                "iteration %d: checkpoint after step %d of the update stored in %.1f s%s",
                self._iteration,
                steps,
                monotonic() - started,
                " (preemption notice: exiting)" if self._stopping else "",
            )
        self._ranks.share(None)  # stored: no rank ends before the leader has stored it
        self._since = monotonic()
        if self._stopping:
            raise Preempted(steps)

    def _store(self, local: Path, folder: str, steps: int) -> None:
        """Upload the folder, then the manifest naming it, then delete the folders before it."""
        self._objects.upload_dir(local, self._prefix + folder)
        seconds = self.earlier_seconds + monotonic() - self._started
        manifest = {"batch_id": self._batch_id, "steps": steps, "folder": folder, "seconds": seconds}
        self._objects.put_bytes(self._prefix + MANIFEST_FILE, json.dumps(manifest).encode())
        for old in _step_folders(self._objects, self._prefix) - {folder}:
            self._objects.delete_prefix(self._prefix + old)
        shutil.rmtree(local)

    def _latest_folder(self) -> str | None:
        """The manifest's checkpoint folder, if the manifest names this batch."""
        key = self._prefix + MANIFEST_FILE
        if not self._objects.exists(key):
            return None
        manifest = json.loads(self._objects.get_bytes(key))
        if manifest["batch_id"] != self._batch_id:
            # Not this batch's (a batch is stored once per iteration, before any checkpoint): unused.
            log.warning("iteration %d: a checkpoint of another batch is ignored", self._iteration)
            return None
        self.earlier_seconds = manifest.get("seconds", 0.0)  # none in a manifest of an earlier release
        log.info(
            "iteration %d: resuming the update after step %d, from its checkpoint", self._iteration, manifest["steps"]
        )
        folder: str = manifest["folder"]
        return folder

    def close(self) -> None:
        """Remove this job's local copies (each machine's first rank)."""
        if self._ranks.node_leader:
            shutil.rmtree(self._local, ignore_errors=True)


def _step_folders(objects: ObjectStore, prefix: str) -> set[str]:
    """The checkpoint folders ("step-<k>/") stored under `prefix`."""
    return {key.removeprefix(prefix).split("/", 1)[0] + "/" for key in objects.list(prefix + "step-")}
