"""Memory and speed of one reward model loaded full (fp32) and int8 (`RewardModel.load(path,
quantize="8bit")`, the CPU path: weight-only int8), each in a fresh subprocess so one's memory
cannot hide the other's.

    .venv/bin/python bench/reward_model_quantized.py [--model smollm2-135m|tiny] [--texts 64] [--rounds 3]
                                                     [--threads 2] [--cache-dir DIR] [--json OUT]

The parent builds the reward model once under the cache directory (the base model's backbone, a
fresh head, `--train-steps` Bradley-Terry steps preferring replies that end in "yes" to "no", so
its scores spread) and reuses it on later runs. Each child process imports torch and transformers,
notes its RSS, loads the model, counts the bytes of its weights (the state dict: parameters and
persistent buffers, int8 weights with their scales), scores the same `--texts` (prompt, response)
pairs once to warm up and `--rounds` times timed, then notes its peak RSS (VmHWM) and what it
holds: anonymous memory and mapped file pages apart. The parent prints both, their ratios, and
how far the int8 scores are from the fp32 ones.

transformers maps the safetensors file rather than reading it, so the fp32 model's weights are
file pages (shared, reclaimable, but resident while the model is in use); the int8 model reads
them once to quantize, copies what stays fp32 and drops the mapping. A benchmark, not a test: it
prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
MODES = ("fp32", "8bit")
WORDS = [
    "the",
    "answer",
    "is",
    "seven",
    "because",
    "we",
    "add",
    "three",
    "and",
    "four",
    "then",
    "check",
    "each",
    "step",
    "twice",
    "so",
    "it",
    "holds",
    "for",
    "all",
    "cases",
    "given",
    "here",
]


def memory() -> dict[str, int]:
    """This process's resident set now and at its peak, in bytes (Linux /proc/self/status).

    VmHWM, not getrusage's ru_maxrss: a child's ru_maxrss starts from its parent's peak."""
    fields = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024  # kB
    return out


def state_dict_bytes(model) -> int:  # noqa: ANN001
    """Bytes of the tensors a state dict holds, each storage once."""
    seen: set[int] = set()
    total = 0
    for value in model.state_dict().values():
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            total += value.numel() * value.element_size()
    return total


def texts(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`n` (prompt, response) pairs of 8-word prompts and 20-60-word responses ending in yes or no."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choices(WORDS, k=8)) + "?" for _ in range(n)]
    responses = [" ".join(rng.choices(WORDS, k=rng.randint(20, 60))) + rng.choice([" yes", " no"]) for _ in range(n)]
    return prompts, responses


def build(model: str, out: Path, cache_dir: Path, train_steps: int) -> None:
    from trainer_core.models.loading import load_policy
    from trainer_core.supervised.reward_model import PreferencePair, RewardModel, RewardModelConfig, train_reward_model

    rng = random.Random(1)
    pairs = []
    for _ in range(8 * train_steps):
        filler = " ".join(rng.choices(WORDS, k=6))
        pairs.append(PreferencePair(" ".join(rng.choices(WORDS, k=5)) + "?", f"{filler} yes", f"{filler} no"))
    rm = RewardModel.from_policy(load_policy(model, cache_dir=cache_dir), max_len=256)
    if pairs:
        train_reward_model(
            rm, pairs, RewardModelConfig(learning_rate=5e-5, batch_size=8, micro_batch_size=4, max_len=256)
        )
    rm.save(out, extra={"base_model": model, "note": "bench/reward_model_quantized.py"})


def child(rm_dir: Path, mode: str, n_texts: int, rounds: int, threads: int) -> dict:
    import torch

    from trainer_core.supervised.reward_model import RewardModel

    torch.set_num_threads(threads)
    before = memory()["rss"]
    start = time.perf_counter()
    model = RewardModel.load(rm_dir, quantize=None if mode == "fp32" else mode)  # type: ignore[arg-type]
    load_s = time.perf_counter() - start
    gc.collect()
    loaded = memory()
    prompts, responses = texts(n_texts)
    scores = model.score(prompts, responses)  # warm-up; the scores compared
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.score(prompts, responses)
        times.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "rss_before_load": before,
        "peak_rss_after_load": loaded["peak_rss"],
        "rss_after_load": loaded["rss"],
        **memory(),
        "weight_bytes": state_dict_bytes(model),
        "load_s": load_s,
        "texts_per_s": n_texts / min(times),
        "scores": scores,
    }


def run_child(rm_dir: Path, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--rm-dir",
            str(rm_dir),
            "--child-out",
            out.name,
            "--texts",
            str(args.texts),
            "--rounds",
            str(args.rounds),
            "--threads",
            str(args.threads),
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def report(full: dict, int8: dict, rm_dir: Path, n_params: int | None) -> str:
    import statistics

    def mib(n: float) -> str:
        return f"{n / MiB:8.1f} MiB"

    diffs = [abs(a - b) for a, b in zip(full["scores"], int8["scores"], strict=True)]
    corr = statistics.correlation(full["scores"], int8["scores"])
    spread = max(full["scores"]) - min(full["scores"])
    rows = [
        ("RSS before load (imports)", "rss_before_load"),
        ("peak RSS after load", "peak_rss_after_load"),
        ("RSS after load", "rss_after_load"),
        ("peak RSS after scoring", "peak_rss"),
        ("RSS after scoring", "rss"),
        ("  anonymous", "rss_anon"),
        ("  mapped file pages", "rss_file"),
        ("weight bytes (state dict)", "weight_bytes"),
    ]
    lines = [
        f"reward model {rm_dir}" + (f" ({n_params / 1e6:.1f}M parameters)" if n_params else ""),
        "",
        f"{'':28} {'fp32':>12} {'int8':>12} {'int8/fp32':>10}",
    ]
    for label, key in rows:
        lines.append(f"{label:28} {mib(full[key])} {mib(int8[key])} {int8[key] / full[key]:10.3f}")
    model_full, model_int8 = full["rss"] - full["rss_before_load"], int8["rss"] - int8["rss_before_load"]
    lines.append(
        f"{'RSS added by load + scoring':28} {mib(model_full)} {mib(model_int8)} {model_int8 / model_full:10.3f}"
    )
    lines.append(
        f"{'load time':28} {full['load_s']:10.2f} s {int8['load_s']:10.2f} s {int8['load_s'] / full['load_s']:10.3f}"
    )
    lines.append(
        f"{'scores per second':28} {full['texts_per_s']:12.1f} {int8['texts_per_s']:12.1f} {int8['texts_per_s'] / full['texts_per_s']:10.3f}"
    )
    lines += [
        "",
        f"scores of {len(diffs)} texts: mean |int8 - fp32| {statistics.fmean(diffs):.4f}, largest {max(diffs):.4f} "
        f"(fp32 scores span {spread:.3f}: {statistics.fmean(diffs) / spread:.2%} and {max(diffs) / spread:.2%} of it), "
        f"correlation {corr:.5f}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="base model of the reward model: smollm2-135m, tiny, a directory or .gguf",
    )
    p.add_argument(
        "--train-steps", type=int, default=8, help="Bradley-Terry steps (8 pairs each) when building the reward model"
    )
    p.add_argument("--texts", type=int, default=64, help="(prompt, response) pairs scored per round")
    p.add_argument("--rounds", type=int, default=3, help="timed scoring rounds after a warm-up; the fastest counts")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in each child")
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("SPOTRL_MODEL_CACHE", ".spotrl/models"),
        help="model cache of load_policy, where the reward model is kept too (default: $SPOTRL_MODEL_CACHE or .spotrl/models)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    # Internal: how the parent starts a child process.
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--rm-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(
            json.dumps(child(args.rm_dir, args.child, args.texts, args.rounds, args.threads))
        )
        return
    cache_dir = Path(args.cache_dir).resolve()
    rm_dir = cache_dir / f"bench-reward-model-{Path(args.model).name}-{args.train_steps}steps"
    if not (rm_dir / "reward_model.json").exists():
        print(f"building {rm_dir} ...", flush=True)
        build(args.model, rm_dir, cache_dir, args.train_steps)
    full, int8 = (run_child(rm_dir, mode, args) for mode in MODES)
    n_params = full["weight_bytes"] // 4  # fp32: 4 bytes per parameter
    print(report(full, int8, rm_dir, n_params))
    print(
        f"\n{args.threads} torch threads, {os.cpu_count()} CPUs; {args.texts} texts of 20-60 words, fastest of {args.rounds} rounds"
    )
    if args.json:
        args.json.write_text(json.dumps({"fp32": full, "8bit": int8}, indent=2))


if __name__ == "__main__":
    main()
