"""spotrl's GRPO trainer against TRL's `GRPOTrainer`, on the same work, on CPU.

    .venv/bin/python bench/trainer_vs_trl.py --model both [--steps N] [--trials 3] [--threads 2]
                                             [--bf16] [--json results.json] [--cache-dir DIR]

A benchmark, not a test: it prints a markdown table (and writes JSON) and asserts nothing
about speed. Each trainer runs in its own subprocess, one after the other, so their memory is
measured apart and neither competes with the other for the cores.

Trials: `--trials N` (default 3) runs both trainers N times, each time in fresh processes,
alternating which goes first (trial 0 spotrl first, trial 1 TRL first, ...), so slow drifts in
the machine's load fall on both. The table shows, for each trainer, the median over the trials
of each figure, and as ratios the median of the per-trial ratios (each measured side by side in
one trial); the per-trial ratios are listed below it, and the JSON keeps every trial. The model
is materialised once per model, by a "prepare" process, before the first trial.

What "the same work" means (per step, for both trainers)
---------------------------------------------------------
- Policy: the same fp32 weights and tokenizer, from `trainer_core.models.load_policy` (both
  processes load them the same way; TRL gets the model and tokenizer objects). `--bf16` turns on
  bf16 autocast for both (spotrl `TrainConfig.autocast_bf16`, TRL `bf16=True`); master weights
  and AdamW state stay fp32 either way. (CPUs without AVX512-BF16/AMX emulate bf16, slowly.)
- Prompts: 2 distinct arithmetic prompts per step ("What is a + b? Reply with only the
  number."), a fresh pair each step, in the same order for both. spotrl encodes them with
  `encode_prompt` (the chat template when the tokenizer has one); TRL gets them as
  conversational prompts (or plain text for a tokenizer without a template) and tokenizes them
  itself; the TRL worker checks that its prompt ids equal spotrl's before training.
- Rollout: 4 samples per prompt (8 completions per step), temperature 1.0, top-p 1, at most 32
  new tokens, stopping at the same token ids (spotrl's `stop_token_ids`; TRL's generation config
  is given the same list). Reward: 1.0 when the completion's last number equals a + b.
- Update: GRPO advantages, clipped surrogate (eps 0.2), no KL term and no reference model
  (beta = 0), one forward/backward over all 8 samples and one AdamW step per batch (spotrl:
  one `train_on_batch`, mini_batch 0, micro_batch 8; TRL: per_device_train_batch_size
  8, gradient_accumulation_steps 1, steps_per_generation 1, num_iterations 1), gradient-norm clip
  1.0, the same constant learning rate, no weight decay. Each trainer keeps its own optimizer
  implementation (both end up on torch's fused AdamW on torch >= 2.8).
- Steps: `--warmup` steps (default 1; optimizer state is allocated there), then `--steps`
  measured steps (default 40 on the tiny model, whose steps take ~60 ms, and 5 on SmolLM2).
- Environment: both workers are started with one and the same environment dict: the parent's
  environment (malloc settings such as MALLOC_ARENA_MAX or LD_PRELOAD inherited unchanged, so
  identical) plus OMP_NUM_THREADS = MKL_NUM_THREADS = `--threads`, and each calls
  `torch.set_num_threads(--threads)` before loading. Every worker is a fresh process.
- TRL at its best documented CPU settings (TRL 1.16 `GRPOConfig`): `use_cpu=True`; bf16 only
  with `--bf16` (TRL's default turns it on, which CPUs without bf16 units emulate); gradient
  (activation) checkpointing off (TRL's default turns it on, recomputing the forward);
  `torch_compile` off, `dataloader_num_workers` 0 and no pinned memory (the defaults: compiling
  costs more than a few steps gain, and the prompt rows are tiny); no logging, reporting, tqdm
  or checkpoint saving. Generation keeps the KV cache (TRL's `GenerationConfig` default;
  `TrainingArguments.use_cache=False` only concerns the training forward).
- DeepSpeed hidden from TRL: where `deepspeed` is installed, transformers/accelerate/TRL may
  import it in TRL's process (it logs "Setting accelerator to CPU"), which costs memory and
  start-up (about 16 MB of peak RSS on the tiny model) and is no use in one CPU process.
  The TRL worker puts `sys.modules["deepspeed"] = None` before importing them, so
  `importlib.util.find_spec("deepspeed")` returns None, every `is_deepspeed_available()`
  (transformers, accelerate, TRL) reports False, and `import deepspeed` fails. Each worker
  records whether deepspeed was imported at its first step; the table's head line shows it.

Differences that are each trainer's own design and stay in: spotrl samples with its own KV-cache
loop (`HFEngine`, whose decode products run through its small-batch CPU kernel,
`trainer_core.engines.small_batch_linear`) and keeps the behaviour log-probs; TRL calls `model.generate` and, with
num_iterations 1, reuses the training forward's detached log-probs as the old ones; TRL also
computes per-token entropy for its metrics, and builds its trainer on `transformers.Trainer`.
Sampling draws different random completions in the two processes, so completion lengths (and
hence tokens per step) differ a little: the table shows the mean completion length.

How each number is measured
---------------------------
- seconds/step: wall time of a full RL step (tokenize prompts, generate 8 completions, reward,
  forward/backward, clip, optimizer step), mean over the measured steps. spotrl: around the
  step's code in the worker loop. TRL: from `TrainerCallback.on_step_begin` to `on_step_end`,
  so model loading and trainer construction are excluded (fetching the step's prompt rows from
  the dataloader happens just before `on_step_begin`, and is negligible).
- generate s/step: spotrl `HFEngine.generate`; TRL the policy's `model.generate`, timed by a
  wrapper put on the model instance. optimizer s/step: the `optimizer.step()` call alone
  (spotrl through torch's optimizer step hooks; TRL between `on_pre_optimizer_step` and
  `on_optimizer_step`). The rest of a step is scoring: forward, backward, losses, clipping.
- CPU s/step: process CPU time (`time.process_time`, all threads) over the same window. On a
  shared machine wall time swings with other load, while single-threaded CPU time barely
  does; with several threads it is inflated by OpenMP threads spinning while a sibling is
  descheduled. `--threads 1` gives the steadiest comparison on a busy machine; the
  "tokens/CPU-s" ratio is printed beside the wall-clock one.
- tokens/s: tokens processed in the measured steps over their total wall time. A step's tokens
  are, over its 8 completions, prompt tokens plus completion tokens (the unpadded ids, the stop
  token included), counted the same way for both: spotrl from its samples, TRL from the
  `completion_ids` its reward function receives plus the known prompt lengths. Padding is not
  counted.
- peak RSS: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of the worker process at its end: the
  high-water mark of the whole process, imports and model loading included, read the same way
  for both. "RSS at start" is the process's RSS (`VmRSS`) when its first step begins. GB here
  are 10^9 bytes. TRL's process also holds what TRL imports (accelerate, datasets): that is
  part of its cost. Builtin models are materialised (the SmolLM2 GGUF dequantised) by a
  separate process first, so neither peak includes a conversion.
- Both workers call `torch.set_num_threads(--threads)` (and get OMP/MKL_NUM_THREADS) before
  loading; the thread count seen at the first step is recorded.
- Each trial's figures are means over its measured steps; the table shows their median over
  the trials (see "Trials" above).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

MODELS = ("tiny", "smollm2-135m")
# Measured steps by default: a tiny-model step takes ~60 ms, so it takes more of them to measure.
DEFAULT_STEPS = {"tiny": 40, "smollm2-135m": 5}
TARGET_MODEL = "smollm2-135m"
TARGET_SPEEDUP, TARGET_RSS_RATIO = 2.5, 0.6  # on TARGET_MODEL
TINY_TARGET_SPEEDUP = 1.0  # on the tiny model: speed only


@dataclass
class BenchConfig:
    """One model's benchmark settings, handed to each worker process as JSON."""

    model: str  # builtin name given to trainer_core.models.load_policy
    cache_dir: str  # where load_policy materialises builtin models
    steps: int = 5  # measured steps
    warmup: int = 1  # steps run first and not measured
    threads: int = 2  # torch.set_num_threads in each worker
    bf16: bool = False  # bf16 autocast for forward passes (weights and optimizer stay fp32)
    learning_rate: float = 1e-5  # constant AdamW learning rate of both trainers
    prompts_per_step: int = 2  # distinct prompts per step
    samples_per_prompt: int = 4  # GRPO group size (TRL num_generations)
    max_new_tokens: int = 32  # TRL max_completion_length
    temperature: float = 1.0  # sampling temperature, and the divisor of the trained logits
    clip_ratio: float = 0.2  # PPO clip eps (TRL epsilon)
    max_grad_norm: float = 1.0  # gradient-norm clip before each optimizer step
    seed: int = 0  # prompt set, torch RNG, spotrl's per-step sampling seeds, TRL's seed

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def batch_size(self) -> int:
        """Completions per step, which is also the samples per optimizer step."""
        return self.prompts_per_step * self.samples_per_prompt


@dataclass
class StepRecord:
    """What one worker measured for one step."""

    seconds: float
    cpu_s: float  # process CPU time (all threads) over the step
    generate_s: float  # inside the step: sampling the 8 completions
    optimizer_s: float  # inside the step: optimizer.step() alone
    tokens: int  # prompt + completion tokens over the step's completions
    completion_tokens: int  # of which completion tokens
    mean_reward: float  # mean exact-match reward of the step's completions


# ---------------------------------------------------------------------------------------------
# The work both trainers share


def arithmetic_prompts(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` (prompt, answer) pairs "What is a + b?", the demo's prompts."""
    from services.tooling.arithmetic import arithmetic_prompts as demo_prompts

    return [(item["prompt"], item["answer"]) for item in demo_prompts(count, seed)]


def exact_match(text: str, answer: str) -> float:
    """1.0 when the last number in `text` equals `answer` (the run reward of the same name)."""
    from services.data.reward.functions import last_number

    got = last_number(text)
    return float(got is not None and abs(got - float(answer)) < 1e-9)


# ---------------------------------------------------------------------------------------------
# Process measurements


def rss_gb() -> float:
    """Current resident set size of this process (VmRSS), in GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("VmRSS not found in /proc/self/status")


def peak_rss_gb() -> float:
    """High-water RSS of this whole process so far, in GB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def deepspeed_imported() -> bool:
    """Whether this process has imported deepspeed (a None entry means it is hidden)."""
    return sys.modules.get("deepspeed") is not None


def hide_deepspeed() -> None:
    """Make deepspeed look absent to this process: `importlib.util.find_spec("deepspeed")` then
    returns None, so the `is_deepspeed_available()` checks of transformers, accelerate and TRL
    report False, and `import deepspeed` raises ModuleNotFoundError. Call before importing them."""
    if not deepspeed_imported():
        sys.modules["deepspeed"] = None


def _setup_torch(cfg: BenchConfig):
    import torch

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    return torch


# ---------------------------------------------------------------------------------------------
# spotrl worker


def run_spotrl(cfg: BenchConfig) -> dict[str, Any]:
    """Run `cfg.total_steps` full spotrl GRPO steps; returns per-step records and memory."""
    torch = _setup_torch(cfg)
    from contracts.training import TrainConfig
    from trainer_core.engines.hf import HFEngine, SamplingParams
    from trainer_core.models.loading import encode_prompt, load_policy
    from trainer_core.rl.strategy import build_optimizer
    from trainer_core.rl.update import train_on_batch

    policy = load_policy(cfg.model, cache_dir=Path(cfg.cache_dir))
    model, tokenizer = policy.model, policy.tokenizer
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=cfg.temperature, top_p=1.0, max_new_tokens=cfg.max_new_tokens)
    train_cfg = TrainConfig(
        algorithm="grpo",
        learning_rate=cfg.learning_rate,
        epochs=1,
        mini_batch=0,  # the whole batch: one optimizer step per batch
        micro_batch=cfg.batch_size,  # one forward/backward, like TRL's batch of 8
        clip_ratio=cfg.clip_ratio,
        kl_coef=0.0,
        temperature=cfg.temperature,
        max_grad_norm=cfg.max_grad_norm,
        autocast_bf16=cfg.bf16,
    )
    optimizer = build_optimizer(model, train_cfg)
    optimizer_timer = _OptimizerTimer(optimizer)
    items = arithmetic_prompts(cfg.total_steps * cfg.prompts_per_step, cfg.seed)

    rss_start, threads, deepspeed, records = rss_gb(), torch.get_num_threads(), deepspeed_imported(), []
    for step in range(cfg.total_steps):
        pairs = items[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
        optimizer_timer.seconds = 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        prompts = [encode_prompt(tokenizer, text) for text, _ in pairs]
        repeated = [ids for ids in prompts for _ in range(cfg.samples_per_prompt)]  # (batch,)
        generate_start = time.perf_counter()
        completions = engine.generate(repeated, params, seed=cfg.seed + step)
        generate_s = time.perf_counter() - generate_start
        samples = _scored_samples(tokenizer, pairs, repeated, completions, step, cfg.samples_per_prompt)
        train_on_batch(model, samples, train_cfg, optimizer)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        completion_tokens = sum(len(s.response_ids) for s in samples)
        records.append(
            StepRecord(
                seconds=seconds,
                cpu_s=cpu_s,
                generate_s=generate_s,
                optimizer_s=optimizer_timer.seconds,
                tokens=completion_tokens + sum(len(s.prompt_ids) for s in samples),
                completion_tokens=completion_tokens,
                mean_reward=sum(s.reward for s in samples) / len(samples),
            )
        )
    return _worker_result(records, rss_start, threads, deepspeed)


def _scored_samples(tokenizer, pairs, prompts, completions, step: int, group_size: int) -> list:
    """One step's spotrl samples: completion i continues prompts[i], which is pair i // group_size;
    each carries its exact-match reward and behaviour log-probs, grouped by prompt."""
    from contracts.samples import Sample

    samples = []
    for i, (prompt_ids, completion) in enumerate(zip(prompts, completions, strict=True)):
        group = f"{step}-{i // group_size}"
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        samples.append(
            Sample(
                sample_id=f"{step}-{i}",
                run_id="bench",
                prompt_id=group,
                group_id=group,
                prompt_ids=list(prompt_ids),
                response_ids=completion.token_ids,
                logprobs=completion.logprobs,
                reward=exact_match(text, pairs[i // group_size][1]),
                reward_source="exact_match",
                policy_version=step,
                worker_id="bench",
                generation_seconds=0.0,
                created_at=time.time(),
            )
        )
    return samples


class _OptimizerTimer:
    """Seconds spent in `optimizer.step()`, through torch's step pre/post hooks."""

    def __init__(self, optimizer) -> None:
        self.seconds = 0.0
        self._start = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start


# ---------------------------------------------------------------------------------------------
# TRL worker


def run_trl(cfg: BenchConfig) -> dict[str, Any]:
    """Run `cfg.total_steps` steps of TRL's GRPOTrainer; returns per-step records and memory."""
    hide_deepspeed()
    torch = _setup_torch(cfg)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer_core.models.loading import encode_prompt, load_policy, stop_token_ids

    policy = load_policy(cfg.model, cache_dir=Path(cfg.cache_dir))
    model, tokenizer = policy.model, policy.tokenizer
    # TRL stops at the generation config's eos ids (plus the tokenizer's eos): give it spotrl's set.
    model.generation_config.eos_token_id = stop_token_ids(tokenizer)
    conversational = bool(tokenizer.chat_template)
    items = arithmetic_prompts(cfg.total_steps * cfg.prompts_per_step, cfg.seed)
    prompt_len = {text: len(encode_prompt(tokenizer, text)) for text, _ in items}
    rows = [
        {"prompt": [{"role": "user", "content": text}] if conversational else text, "answer": answer}
        for text, answer in items
    ]

    class StepRecorder(TrainerCallback):
        """Times each optimizer step from on_step_begin to on_step_end; the reward function and
        the generate wrapper add the step's tokens and generation time."""

        def __init__(self) -> None:
            self.records: list[StepRecord] = []
            self.rss_start = self.threads = self.deepspeed = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.rss_start is None:
                self.rss_start, self.threads = rss_gb(), torch.get_num_threads()
                self.deepspeed = deepspeed_imported()
            self.generate_s = self.optimizer_s = 0.0
            self.tokens = self.completion_tokens = 0
            self.rewards: list[float] = []
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_s += time.perf_counter() - self.optimizer_start

        def on_step_end(self, args, state, control, **kwargs):
            self.records.append(
                StepRecord(
                    seconds=time.perf_counter() - self.start,
                    cpu_s=time.process_time() - self.cpu_start,
                    generate_s=self.generate_s,
                    optimizer_s=self.optimizer_s,
                    tokens=self.tokens,
                    completion_tokens=self.completion_tokens,
                    mean_reward=sum(self.rewards) / len(self.rewards),
                )
            )

    recorder = StepRecorder()

    def exact_match_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if conversational else c for c in completions]
        prompt_texts = [p[-1]["content"] if conversational else p for p in prompts]
        recorder.completion_tokens += sum(len(ids) for ids in completion_ids)
        recorder.tokens += sum(len(ids) for ids in completion_ids) + sum(prompt_len[t] for t in prompt_texts)
        rewards = [exact_match(text, a) for text, a in zip(texts, answer, strict=True)]
        recorder.rewards += rewards
        return rewards

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            # On CPU: TRL's defaults turn on bf16 and gradient checkpointing.
            use_cpu=True,
            bf16=cfg.bf16,
            **_no_activation_checkpointing(GRPOConfig),
            per_device_train_batch_size=cfg.batch_size,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            num_generations=cfg.samples_per_prompt,
            max_completion_length=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=1.0,
            beta=0.0,
            epsilon=cfg.clip_ratio,
            learning_rate=cfg.learning_rate,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=cfg.max_grad_norm,
            max_steps=cfg.total_steps,
            shuffle_dataset=False,  # the same prompt pairs, in the same order, as spotrl
            seed=cfg.seed,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[recorder],
        )
        _check_same_prompt_ids(trainer, rows, tokenizer)
        _time_generate(trainer.model, recorder)
        trainer.train()
    return _worker_result(recorder.records, recorder.rss_start, recorder.threads, recorder.deepspeed)


def _no_activation_checkpointing(config_class) -> dict[str, bool]:
    """The argument turning checkpointing off: transformers 5.24 renamed gradient_checkpointing
    to activation_checkpointing (the old name still works, with a FutureWarning)."""
    if "activation_checkpointing" in config_class.__dataclass_fields__:
        return {"activation_checkpointing": False}
    return {"gradient_checkpointing": False}


def _check_same_prompt_ids(trainer, rows: list[dict[str, Any]], tokenizer) -> None:
    """Fail unless TRL tokenizes each prompt to exactly spotrl's ids.

    Calls the method GRPOTrainer itself uses (`_tokenize_prompts`, private in TRL 1.16), so the
    check follows whatever TRL really feeds its model.
    """
    from trainer_core.models.loading import encode_prompt

    trl_ids, _, _ = trainer._tokenize_prompts([row["prompt"] for row in rows])
    for row, ids in zip(rows, trl_ids, strict=True):
        text = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
        if list(ids) != encode_prompt(tokenizer, text):
            raise RuntimeError(f"TRL and spotrl tokenize {text!r} differently")


def _time_generate(model, recorder) -> None:
    """Add the seconds of every `model.generate` call to `recorder.generate_s`."""
    generate = model.generate

    def timed_generate(*args: Any, **kwargs: Any):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            recorder.generate_s += time.perf_counter() - start

    model.generate = timed_generate


# ---------------------------------------------------------------------------------------------
# Worker plumbing


def prepare_model(cfg: BenchConfig) -> dict[str, Any]:
    """Materialise the model in the cache (a GGUF dequantise for SmolLM2) before the measured
    workers start, so neither worker's peak RSS includes a conversion."""
    from trainer_core.models.loading import load_policy

    load_policy(cfg.model, cache_dir=Path(cfg.cache_dir))
    return {}


def _worker_result(records: list[StepRecord], rss_start: float, threads: int, deepspeed: bool) -> dict[str, Any]:
    return {
        "steps": [asdict(r) for r in records],
        "rss_start_gb": rss_start,
        "peak_rss_gb": peak_rss_gb(),
        "torch_threads": threads,
        "deepspeed_imported": deepspeed,
    }


WORKERS = {"prepare": prepare_model, "spotrl": run_spotrl, "trl": run_trl}
TRAINERS = ("spotrl", "trl")


def worker_env(threads: int) -> dict[str, str]:
    """The one environment every worker process gets: this process's (malloc settings
    included, unchanged) with the OpenMP/MKL thread counts set to `threads`."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def run_worker(name: str, cfg: BenchConfig, env: dict[str, str]) -> dict[str, Any]:
    """Run `WORKERS[name]` in a fresh Python process with environment `env`; returns what it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                name,
                "--worker-config",
                json.dumps(asdict(cfg)),
                "--worker-out",
                out.name,
            ],
            env=env,
            stdout=sys.stderr,  # the Trainer's own printouts stay off the table on stdout
            check=True,
        )
        return json.loads(Path(out.name).read_text())


def summarise(result: dict[str, Any], cfg: BenchConfig) -> dict[str, float]:
    """Means over the measured steps (the warm-up steps dropped) and memory, in GB."""
    steps = result["steps"][cfg.warmup :]
    n, seconds = len(steps), sum(s["seconds"] for s in steps)
    return {
        "seconds_per_step": seconds / n,
        "tokens_per_s": sum(s["tokens"] for s in steps) / seconds,
        "cpu_s_per_step": sum(s["cpu_s"] for s in steps) / n,
        "tokens_per_cpu_s": sum(s["tokens"] for s in steps) / sum(s["cpu_s"] for s in steps),
        "generate_s_per_step": sum(s["generate_s"] for s in steps) / n,
        "optimizer_s_per_step": sum(s["optimizer_s"] for s in steps) / n,
        "tokens_per_step": sum(s["tokens"] for s in steps) / n,
        "completion_tokens_per_sample": sum(s["completion_tokens"] for s in steps) / n / cfg.batch_size,
        "mean_reward": sum(s["mean_reward"] for s in steps) / n,
        "peak_rss_gb": result["peak_rss_gb"],
        "rss_start_gb": result["rss_start_gb"],
        "torch_threads": result["torch_threads"],
    }


def ratios(spotrl: dict[str, float], trl: dict[str, float]) -> dict[str, float]:
    """spotrl / TRL on the figures the target speaks of."""
    return {
        "tokens_per_s": spotrl["tokens_per_s"] / trl["tokens_per_s"],
        "tokens_per_cpu_s": spotrl["tokens_per_cpu_s"] / trl["tokens_per_cpu_s"],
        "peak_rss": spotrl["peak_rss_gb"] / trl["peak_rss_gb"],
    }


def run_trial(cfg: BenchConfig, trial: int, env: dict[str, str]) -> dict[str, Any]:
    """Both trainers once, each in a fresh process; spotrl first in even trials, TRL in odd ones."""
    order = TRAINERS if trial % 2 == 0 else TRAINERS[::-1]
    runs = {}
    for name in order:
        print(f"[{cfg.model}] trial {trial}: running {name} ...", file=sys.stderr, flush=True)
        result = run_worker(name, cfg, env)
        runs[name] = summarise(result, cfg) | {
            "deepspeed_imported": result["deepspeed_imported"],
            "raw_steps": result["steps"],
        }
    return {"first": order[0], **runs, "ratio_spotrl_over_trl": ratios(runs["spotrl"], runs["trl"])}


def compare(cfg: BenchConfig, trials: int) -> dict[str, Any]:
    """`trials` alternating trials of both trainers on `cfg.model`: every trial, and as the
    result's "spotrl", "trl" and "ratio_spotrl_over_trl" the medians, of each trainer's figures
    over the trials and of the per-trial spotrl/TRL ratios."""
    env = worker_env(cfg.threads)
    run_worker("prepare", cfg, env)
    runs = [run_trial(cfg, trial, env) for trial in range(trials)]
    medians: dict[str, Any] = {}
    for name in TRAINERS:
        figures = [key for key in runs[0][name] if key not in ("deepspeed_imported", "raw_steps")]
        medians[name] = {key: median(run[name][key] for run in runs) for key in figures}
        medians[name]["deepspeed_imported"] = any(run[name]["deepspeed_imported"] for run in runs)
    ratio = {key: median(run["ratio_spotrl_over_trl"][key] for run in runs) for key in runs[0]["ratio_spotrl_over_trl"]}
    return {
        "config": asdict(cfg),
        "statistic": f"median of {trials} trials",
        **medians,
        "ratio_spotrl_over_trl": ratio,
        "trials": runs,
    }


# ---------------------------------------------------------------------------------------------
# Report


def markdown_table(result: dict[str, Any]) -> str:
    """One model's results as markdown: the table of trial medians, the per-trial ratios, the target."""
    cfg, trials = result["config"], result["trials"]
    spotrl, trl, ratio = (result[k] for k in ("spotrl", "trl", "ratio_spotrl_over_trl"))
    rows = [
        "| trainer | s/step | tokens/s | generate s/step | optimizer s/step | CPU s/step | peak RSS GB "
        "| RSS at start GB | tokens/step | completion tokens/sample | mean reward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in (("spotrl", spotrl), (f"TRL {_trl_version()} GRPOTrainer", trl)):
        rows.append(
            f"| {label} | {s['seconds_per_step']:.2f} | {s['tokens_per_s']:.0f} | {s['generate_s_per_step']:.2f} "
            f"| {s['optimizer_s_per_step']:.3f} | {s['cpu_s_per_step']:.2f} | {s['peak_rss_gb']:.2f} "
            f"| {s['rss_start_gb']:.2f} | {s['tokens_per_step']:.0f} | {s['completion_tokens_per_sample']:.1f} "
            f"| {s['mean_reward']:.2f} |"
        )
    rows.append(
        f"| **spotrl / TRL** | | **{ratio['tokens_per_s']:.2f}x** | | "
        f"| {ratio['tokens_per_cpu_s']:.2f}x tokens/CPU-s | **{ratio['peak_rss']:.2f}x** | | | | |"
    )
    per_trial = [
        "| trial | first | tokens/s | tokens/CPU-s | peak RSS |",
        "|---:|---|---:|---:|---:|",
    ]
    for i, run in enumerate(trials):
        r = run["ratio_spotrl_over_trl"]
        first = "spotrl" if run["first"] == "spotrl" else "TRL"
        per_trial.append(
            f"| {i} | {first} | {r['tokens_per_s']:.2f}x | {r['tokens_per_cpu_s']:.2f}x | {r['peak_rss']:.2f}x |"
        )
    yes_no = {True: "yes", False: "no"}
    head = (
        f"**{cfg['model']}**: {cfg['prompts_per_step']} prompts x {cfg['samples_per_prompt']} samples, "
        f"<= {cfg['max_new_tokens']} new tokens, T={cfg['temperature']}, one AdamW step per batch, "
        f"lr {cfg['learning_rate']:g}, {'bf16 autocast' if cfg['bf16'] else 'fp32'}, "
        f"{cfg['threads']} torch threads (seen: spotrl {spotrl['torch_threads']:g}, TRL {trl['torch_threads']:g}), "
        f"deepspeed imported: spotrl {yes_no[spotrl['deepspeed_imported']]}, TRL {yes_no[trl['deepspeed_imported']]}; "
        f"median of {len(trials)} alternating trials, each the mean of {cfg['steps']} steps after "
        f"{cfg['warmup']} warm-up"
    )
    lines = [head, "", *rows, "", "spotrl / TRL in each trial:", "", *per_trial]
    target = _target_line(cfg["model"], ratio)
    if target:
        lines += ["", target]
    return "\n".join(lines)


def _target_line(model: str, ratio: dict[str, float]) -> str | None:
    """Whether the median ratios meet `model`'s target (speed and memory on SmolLM2, speed on
    the tiny model); None for a model without one."""
    got = f"{ratio['tokens_per_s']:.2f}x tokens/s, {ratio['peak_rss']:.2f}x peak RSS"
    if model == TARGET_MODEL:
        met = ratio["tokens_per_s"] >= TARGET_SPEEDUP and ratio["peak_rss"] <= TARGET_RSS_RATIO
        goal = f"target on SmolLM2-135M: >= {TARGET_SPEEDUP}x TRL tokens/s at <= {TARGET_RSS_RATIO}x its peak RSS"
    elif model == "tiny":
        met = ratio["tokens_per_s"] >= TINY_TARGET_SPEEDUP
        goal = f"target on tiny: >= {TINY_TARGET_SPEEDUP}x TRL tokens/s"
    else:
        return None
    return f"{goal}: {'met' if met else 'not met'} ({got})"


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def _machine_note() -> str:
    load1, load5, _ = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {load1:.1f} (1 min) / {load5:.1f} (5 min) at the end of the run"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which policy to benchmark")
    p.add_argument(
        "--steps", type=int, default=None, help="measured steps per trainer (default: tiny 40, smollm2-135m 5)"
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--trials", type=int, default=3, help="alternating trials of both trainers (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for both (fp32 master weights)")
    p.add_argument("--lr", type=float, default=1e-5, help="constant learning rate of both")
    p.add_argument("--seed", type=int, default=0, help="prompt set and sampling seed")
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("SPOTRL_MODEL_CACHE", ".spotrl/models"),
        help="model cache of load_policy (default: $SPOTRL_MODEL_CACHE or .spotrl/models, as the services use)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    # Internal: how the parent starts a worker process.
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        cfg = BenchConfig(**json.loads(args.worker_config))
        Path(args.worker_out).write_text(json.dumps(WORKERS[args.worker](cfg)))
        return
    if (args.steps is not None and args.steps < 1) or args.warmup < 0 or args.trials < 1:
        raise SystemExit("--steps and --trials must be >= 1, and --warmup >= 0")
    models = MODELS if args.model == "both" else (args.model,)
    results = []
    for model in models:
        cfg = BenchConfig(
            model=model,
            cache_dir=str(Path(args.cache_dir).resolve()),
            steps=args.steps or DEFAULT_STEPS[model],
            warmup=args.warmup,
            threads=args.threads,
            bf16=args.bf16,
            learning_rate=args.lr,
            seed=args.seed,
        )
        results.append(compare(cfg, args.trials))
    note = _machine_note()
    print("\n\n".join(markdown_table(r) for r in results))
    print(f"\n_{note}; timings on a shared machine are noisy._")
    if args.json:
        args.json.write_text(json.dumps({"machine": note, "results": results}, indent=2))


if __name__ == "__main__":
    main()
