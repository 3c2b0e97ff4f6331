"""Import time and peak RSS of the control plane: the API app and the scheduler, in a fresh
interpreter each time (what a control-plane container pays at start).

    .venv/bin/python bench/control_plane_import.py [--runs 5] [--root DIR]

`--root` measures another checkout (e.g. a worktree of an older commit) with this venv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import resource, sys, time
started = time.perf_counter()
import services.control.api.main, services.control.scheduler.loop
seconds = time.perf_counter() - started
print(__import__("json").dumps({
    "seconds": seconds,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "modules": len(sys.modules),
    "torch": "torch" in sys.modules,
}))
"""


def measure(root: str | None, runs: int) -> dict:
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], cwd=root, check=True, capture_output=True, text=True).stdout
        samples.append(json.loads(out))
    return {
        "seconds_median": statistics.median(s["seconds"] for s in samples),
        "peak_rss_mb_median": statistics.median(s["peak_rss_mb"] for s in samples),
        "modules": samples[-1]["modules"],
        "torch_imported": samples[-1]["torch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", help="checkout to import from (default: the installed spotrl)")
    args = parser.parse_args()
    m = measure(args.root, args.runs)
    print(
        f"control plane import: {m['seconds_median']:.2f} s, peak RSS {m['peak_rss_mb_median']:.0f} MB, "
        f"{m['modules']} modules, torch imported: {m['torch_imported']} (median of {args.runs})"
    )


if __name__ == "__main__":
    main()
