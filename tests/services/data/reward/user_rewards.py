"""Users' reward files, as the tests write them: a verl-style GSM8K reward, a batched one, a
dict-returning one, and a hostile one that misbehaves as its data_source says."""

from __future__ import annotations

from pathlib import Path

# Shaped as verl's utils/reward_score/gsm8k.py, behind the custom-reward signature.
GSM8K = """
import re

_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
        if len(solutions) == 0:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    answer = re.findall("(\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
    for final_answer in reversed(answer):
        if final_answer not in ["", "."]:
            return final_answer
    return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0, score=1.0):
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    if answer == ground_truth:
        return score
    return format_score
"""

# verl's BatchRewardManager form; "n" says how many items the call was given.
BATCHED = """
import os


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    if "raise" in data_sources:
        raise RuntimeError("SECRET-USER-TEXT")
    if "short" in data_sources:
        return [1.0]
    n = len(solution_strs)
    return [{"score": float(s.strip() == g), "n": n, "pid": os.getpid()} for s, g in zip(solution_strs, ground_truths)]
"""

DICT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 2.0 if correct else -1.0, "acc": correct, "pred": solution_str, "format": 1, "bad": float("nan")}
"""

HOSTILE = """
import math
import os
import subprocess
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "raise":
        raise ValueError("SECRET-USER-TEXT")
    if data_source == "hang":
        time.sleep(3600)
    if data_source == "busy":
        while True:
            pass
    if data_source == "exit":
        os._exit(1)
    if data_source == "segfault":
        import ctypes
        ctypes.string_at(0)
    if data_source == "memory":
        return len(bytearray(10 * 2**30))
    if data_source == "memory-grow":
        held = []
        while True:  # bytes(n) is calloc'd: address space taken at once, pages touched only when used
            held.append(bytes(128 << 20))
    if data_source == "exit-call":
        raise SystemExit(3)
    if data_source == "child-then-hang":
        child = subprocess.Popen(["sleep", "600"])
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(3600)
    returned = {"nan": float("nan"), "inf": math.inf, "string": "1.0", "none": None, "no-score": {"acc": 1.0}}
    if data_source in returned:
        return returned[data_source]
    return {"score": float(solution_str.strip() == str(ground_truth)), "pid": os.getpid()}
"""

# Each misbehaviour and the failure it is reported as.
MISBEHAVIOURS = {
    "raise": "exception",
    "exit-call": "exception",
    "hang": "timeout",
    "busy": "timeout",
    "exit": "crash",
    "segfault": "crash",
    "memory": "memory",
    "memory-grow": "memory",
    "nan": "invalid",
    "inf": "invalid",
    "string": "invalid",
    "none": "invalid",
    "no-score": "invalid",
}


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(source)
    return path
