"""One rank of a 2-process spot training job for `test_job_resume`, run under torchrun as a
training pod runs the job (its backends from the pod's environment, its spec from the state
store); with ``--notice-rank R --notice-after K`` rank R alone gets the preemption notice
(SIGTERM) after step K of the update, and every rank must stop with the checkpoint stored.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/services/data/training/spot_job_worker.py RUN ITERATION [--notice-rank 1 --notice-after 2]

Each rank exits with its job's status: 0, or EXIT_PREEMPTED.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def main() -> None:
    from services.core.config import Settings
    from services.data.training.job import run_training_job
    from services.data.training.update_checkpoint import Preempted, UpdateCheckpointStore
    from services.domain.runspec import RunSpec
    from services.ports.wiring import open_backends
    from trainer_core.rl.distributed import exit_rank

    parser = argparse.ArgumentParser()
    parser.add_argument("run_id")
    parser.add_argument("iteration", type=int)
    parser.add_argument("--notice-rank", type=int)
    parser.add_argument("--notice-after", type=int)
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)

    if args.notice_rank == int(os.environ["RANK"]):
        due = UpdateCheckpointStore.due

        def noticed(self: UpdateCheckpointStore, steps: int) -> bool:
            if steps == args.notice_after:
                os.kill(os.getpid(), signal.SIGTERM)
            return due(self, steps)

        UpdateCheckpointStore.due = noticed  # type: ignore[method-assign]

    settings = Settings()
    backends = open_backends(settings)
    spec = RunSpec.from_stored(backends.state.get_run(args.run_id).spec)
    code = 0
    try:
        run_training_job(
            run_id=args.run_id,
            iteration=args.iteration,
            spec=spec,
            queue=backends.queue,
            objects=backends.objects,
            model_cache=settings.resolved_model_cache(),
        )
    except Preempted as stopped:
        code = stopped.code
    backends.close()
    exit_rank(code)


if __name__ == "__main__":
    sys.exit(main())
