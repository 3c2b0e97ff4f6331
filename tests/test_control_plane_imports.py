"""The control plane (API app, scheduler) starts without torch: a small CPU image can run it.

The import contracts in pyproject.toml check every import statement; this checks what a fresh
interpreter actually loads, lazy imports and plugins included.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "deepspeed", "vllm", "trainer_core")


def test_api_and_scheduler_load_no_torch() -> None:
    probe = (
        "import json, sys\n"
        "from services.control.api.main import create_app\n"
        "from services.control.scheduler.loop import Scheduler\n"
        "create_app()\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    )
    assert "services" in loaded, "the probe imported the control plane"
    assert [m for m in HEAVY if m in loaded] == []
