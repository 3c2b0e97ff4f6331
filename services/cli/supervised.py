"""The supervised steps before PPO, as ``spotrl`` commands: ``sft``, ``train-rm`` and the reward
model's HTTP server ``reward-server``, which also serves a user's own reward function (registered on the app in ``services.cli.main``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from services.cli.common import HomeOption, load_settings, start_logging


def _print_step(step: int, metrics: dict[str, float]) -> None:
    typer.echo(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))


ModelArg = Annotated[
    str, typer.Argument(help="Base model: a builtin name (tiny, smollm2-135m), a HF directory or a .gguf file.")
]
LrOption = Annotated[float, typer.Option("--lr", help="AdamW learning rate.")]
EpochsOption = Annotated[int, typer.Option(help="Passes over the data.")]
MicroBatchOption = Annotated[int, typer.Option("--micro-batch", help="Examples per forward/backward pass.")]
BatchOption = Annotated[int, typer.Option("--batch-size", help="Examples per optimizer step.")]
MaxLenOption = Annotated[int, typer.Option("--max-len", help="Longest example in tokens; longer ones are truncated.")]


def sft(
    model: ModelArg,
    data: Annotated[Path, typer.Argument(help='JSONL of {"prompt": ..., "response": ...} lines.')],
    out: Annotated[Path, typer.Argument(help="Directory for the fine-tuned policy (usable as a run's model).")],
    lr: LrOption = 1e-5,
    epochs: EpochsOption = 1,
    batch_size: BatchOption = 16,
    micro_batch: MicroBatchOption = 4,
    max_len: MaxLenOption = 1024,
    seed: Annotated[int, typer.Option(help="Seed of shuffling and initialisation.")] = 0,
    home: HomeOption = None,
) -> None:
    """Supervised fine-tuning: the loss counts the response tokens only (step 1 of SFT -> RM -> PPO)."""
    from trainer_core.supervised.sft import SFTConfig, run_sft

    cfg = SFTConfig(
        learning_rate=lr, epochs=epochs, batch_size=batch_size, micro_batch_size=micro_batch, max_len=max_len, seed=seed
    )
    metrics = run_sft(model, data, out, cfg, cache_dir=load_settings(home).resolved_model_cache(), on_step=_print_step)
    typer.echo(f"final loss {metrics['sft/loss']:.4f}; policy in {out}")


def train_rm(
    model: ModelArg,
    data: Annotated[Path, typer.Argument(help='JSONL of {"prompt": ..., "chosen": ..., "rejected": ...} lines.')],
    out: Annotated[
        Path,
        typer.Argument(help='Directory for the reward model; a run uses it as {"fn": "reward_model", "path": OUT}.'),
    ],
    eval_data: Annotated[
        Path | None, typer.Option("--eval-data", help="Held-out preference pairs to report accuracy on.")
    ] = None,
    lr: LrOption = 1e-5,
    epochs: EpochsOption = 1,
    batch_size: BatchOption = 16,
    micro_batch: MicroBatchOption = 4,
    max_len: MaxLenOption = 1024,
    seed: Annotated[int, typer.Option(help="Seed of shuffling and of the score head.")] = 0,
    home: HomeOption = None,
) -> None:
    """Train a pairwise (Bradley-Terry) reward model: loss -log sigmoid(r_chosen - r_rejected)."""
    from trainer_core.supervised.reward_model import RewardModelConfig, run_train_rm

    cfg = RewardModelConfig(
        learning_rate=lr, epochs=epochs, batch_size=batch_size, micro_batch_size=micro_batch, max_len=max_len, seed=seed
    )
    metrics = run_train_rm(
        model,
        data,
        out,
        cfg,
        cache_dir=load_settings(home).resolved_model_cache(),
        eval_data=eval_data,
        on_step=_print_step,
    )
    held_out = f", held-out accuracy {metrics['eval/rm/accuracy']:.3f}" if "eval/rm/accuracy" in metrics else ""
    typer.echo(f"pairwise accuracy {metrics['rm/accuracy']:.3f}{held_out}; reward model in {out}")


def reward_server(
    model: Annotated[
        Path | None, typer.Option("--model", help="Directory of a reward model saved by `spotrl train-rm`.")
    ] = None,
    quantize: Annotated[
        Literal["4bit", "8bit"] | None,
        typer.Option(
            "--quantize",
            help="Load the --model's Linear layers in 8 bits: less memory, scores close to the full model's (4bit, for CUDA, is refused: the server loads on the CPU).",
        ),
    ] = None,
    function: Annotated[
        str | None,
        typer.Option(
            "--function",
            help="A reward function taking verl's compute_score arguments: path/to/file.py:name or package.module:name.",
        ),
    ] = None,
    batched: Annotated[
        bool,
        typer.Option(
            "--batched",
            help="Call the function with lists, a chunk at a time (verl's batch form), whatever its parameter names.",
        ),
    ] = False,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes running the function.")] = 2,
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout-s",
            min=0.01,
            help="Time limit of one call of the function; past it the response scores 0.0 and its worker is replaced.",
        ),
    ] = 10.0,
    memory_mb: Annotated[
        int, typer.Option("--memory-mb", min=0, help="Address-space limit of each function worker in MiB (0: none).")
    ] = 4096,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
) -> None:
    """Serve a reward model, or your own reward function, over HTTP: a run's reward term names its URL."""
    import uvicorn

    from services.data.reward.service import create_reward_app

    if (model is None) == (function is None):
        raise typer.BadParameter("give exactly one of --model and --function", param_hint="--model / --function")
    if quantize is not None and model is None:
        raise typer.BadParameter("--quantize is for a reward model (--model)", param_hint="--quantize")
    if quantize == "4bit":
        raise typer.BadParameter(
            "4bit needs a CUDA GPU, and the reward server loads the model on the CPU: use 8bit", param_hint="--quantize"
        )
    if model is not None:
        from contracts.model_sources import check_reward_model_dir

        try:
            check_reward_model_dir(model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--model") from None
        app = create_reward_app(model, quantize=quantize)
    else:
        app = create_reward_app(pool=_function_pool(function or "", batched, workers, timeout_s, memory_mb))
    start_logging()
    uvicorn.run(app, host=host, port=port, log_level="info")


def _function_pool(reference: str, batched: bool, workers: int, timeout_s: float, memory_mb: int):  # noqa: ANN202
    """The started pool for ``reference``; a clear error when it does not import, is missing or
    has the wrong signature."""
    from services.data.reward.function_pool import FunctionPool
    from services.data.reward.user_function import UserFunctionError, resolve

    try:
        function = resolve(reference, batched=batched or None)
        return FunctionPool(function, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb).start()
    except UserFunctionError as e:
        raise typer.BadParameter(str(e), param_hint="--function") from None
