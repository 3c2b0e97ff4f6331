"""What the tracking code costs the control plane: the scheduler with TensorBoard and MLflow sinks
loads no tracker package (no wandb, tensorboard, mlflow, numpy, protobuf), and W&B's package only
once a run asks for W&B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from pathlib import Path
from services.ports.objects.local_object_store import LocalObjectStore
from services.core.config import Settings
from services.domain.runspec import Tracking
from services.control.scheduler.loop import Scheduler
from services.control.tracking.sinks import SinkSet
from services.control.tracking.sync import Tracker

home = Path(sys.argv[1])
sinks = SinkSet(Settings(home=home, mlflow_tracking_uri="http://127.0.0.1:1", wandb_mode="offline"), LocalObjectStore(home))
sinks.for_run(Tracking.model_validate({"tensorboard": True, "mlflow": {"experiment": "e"}}))
loaded = {"without_wandb": sorted({m.split(".")[0] for m in sys.modules})}
sinks.for_run(Tracking.model_validate({"wandb": {"project": "p"}}))
loaded["with_wandb"] = sorted({m.split(".")[0] for m in sys.modules})
sinks.close()
print(json.dumps(loaded))
"""
TRACKER_PACKAGES = ("wandb", "tensorboard", "tensorboardX", "mlflow", "numpy", "google", "torch")


def test_the_scheduler_loads_wandb_only_for_a_run_that_asks_for_it(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert "services" in loaded["without_wandb"], "the probe imported the control plane"
    assert [m for m in TRACKER_PACKAGES if m in loaded["without_wandb"]] == []
    assert "wandb" in loaded["with_wandb"] and "torch" not in loaded["with_wandb"]
