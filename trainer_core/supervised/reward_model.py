"""A scalar reward model trained on pairwise preferences (Bradley-Terry).

The model is a causal LM's backbone (the transformer without its LM head) and a
Linear(hidden, 1) head read at the last token of prompt + response + end-of-turn token, the
sequence `sft.encode_pair` builds, so the score sees the whole reply and how it ends. Training
minimises -log sigmoid(r_chosen - r_rejected) (Ouyang et al. 2022, "Training language models to
follow instructions with human feedback", eq. 1).

A saved reward model is a directory:

    reward_model.json   format marker, max_len
    head.safetensors    the Linear(hidden, 1) head
    backbone/           the backbone and tokenizer (save_pretrained), loaded with AutoModel

`RewardModel.load(path, quantize="8bit")` keeps the backbone's Linear layers in 8 bits (4 bits
on CUDA too) to serve a model in less memory; the head stays fp32. Training is fp32 only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from contracts.model_sources import RM_BACKBONE_DIR, RM_CONFIG_FILE, RM_FORMAT, RM_HEAD_FILE, check_reward_model_dir
from trainer_core.models.int8 import quantize_linears_int8
from trainer_core.models.loading import Policy, load_policy
from trainer_core.supervised.fit import FitSettings, fit, mean_metrics
from trainer_core.supervised.sft import TokenBatch, encode_pair, read_jsonl

# How `RewardModel.load` may quantize the backbone's Linear layers (None: fp32).
Quantize = Literal["4bit", "8bit"]
QUANTIZE_CHOICES: tuple[str, ...] = get_args(Quantize)


@dataclass
class RewardModelConfig:
    """Hyper-parameters of `train_reward_model`."""

    learning_rate: float = 1e-5  # AdamW learning rate of the backbone and the head
    epochs: int = 1  # passes over the preference pairs
    batch_size: int = 16  # pairs per optimizer step
    micro_batch_size: int = 4  # pairs per forward/backward (2x sequences: chosen and rejected)
    max_len: int = 1024  # tokens kept per sequence: the last max_len, so the reply's end is always read
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    max_grad_norm: float = 1.0  # gradient-norm clip per optimizer step
    seed: int = 0  # seeds the head's initialisation and the shuffling of pairs
    packed: bool = True  # micro-batches as one padding-free row (needs a model masked by transformers.masking_utils: Llama, Qwen2, Mistral, Gemma...); False = right-padded rows

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if min(self.epochs, self.batch_size, self.micro_batch_size, self.max_len) < 1:
            raise ValueError("epochs, batch_size, micro_batch_size and max_len must be >= 1")


@dataclass(frozen=True)
class PreferencePair:
    """One line of a preference data set: ``{"prompt": ..., "chosen": ..., "rejected": ...}``."""

    prompt: str
    chosen: str
    rejected: str


def read_preference_pairs(path: Path) -> list[PreferencePair]:
    """Preference pairs from a JSONL file of ``{"prompt", "chosen", "rejected"}`` objects."""
    return [PreferencePair(**r) for r in read_jsonl(path, ("prompt", "chosen", "rejected"))]


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean of -log sigmoid(r_chosen - r_rejected) over pairs `(n_pairs,)`, and detached metrics:
    the fraction of pairs ranked correctly (ties count as wrong) and the mean margin."""
    margin = r_chosen - r_rejected
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "rm/accuracy": (margin > 0).float().mean().detach(),
        "rm/margin": margin.mean().detach(),
    }
    return loss, metrics


class RewardModel(nn.Module):
    """backbone + Linear(hidden, 1) at the last token: one scalar per (prompt, response)."""

    def __init__(
        self, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_len: int = 1024, seed: int = 0
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.max_len = max_len  # the training max_len; scoring keeps the same last tokens
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        # Small random weights keep the first scores near 0 (loss near log 2); a zero head would
        # give the backbone no gradient at first. Seeded apart from the caller's RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            nn.init.normal_(self.head.weight, std=1 / (backbone.config.hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        self.head.to(next(backbone.parameters()).device)

    @classmethod
    def from_policy(cls, policy: Policy, *, max_len: int = 1024, seed: int = 0) -> RewardModel:
        """A reward model on `policy`'s backbone (its LM head is dropped) and a fresh head."""
        return cls(policy.model.base_model, policy.tokenizer, max_len=max_len, seed=seed)

    def encode(self, prompt: str, response: str) -> list[int]:
        """The ids the model reads: prompt, response and end token, the last `max_len` of them."""
        prompt_ids, response_ids = encode_pair(self.tokenizer, prompt, response)
        return [*prompt_ids, *response_ids][-self.max_len :]

    def forward(self, sequences: Sequence[Sequence[int]], *, packed: bool = True) -> Tensor:
        """Scores of token-id sequences, `(n_sequences,)` fp32."""
        batch = TokenBatch.build(sequences, packed=packed)
        hidden = batch.hidden_states(self.backbone)  # (rows * row_len, hidden)
        last = torch.tensor([s + n - 1 for s, n in zip(batch.starts, batch.lengths, strict=True)], device=hidden.device)
        return self.head(hidden[last].float()).squeeze(-1)

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], responses: Sequence[str], *, micro_batch_size: int = 16, packed: bool = True
    ) -> list[float]:
        """One score per (prompt, response), computed `micro_batch_size` sequences per forward."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        sequences = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        was_training = self.training
        self.eval()
        try:
            scores = [
                self(sequences[start : start + micro_batch_size], packed=packed)
                for start in range(0, len(sequences), micro_batch_size)
            ]
        finally:
            self.train(was_training)
        return torch.cat(scores).tolist() if scores else []

    def save(self, out_dir: Path, *, extra: dict | None = None) -> None:
        """Write the directory `RewardModel.load` reads; `extra` (how it was trained) goes into
        its json."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(out_dir / RM_BACKBONE_DIR)
        self.tokenizer.save_pretrained(out_dir / RM_BACKBONE_DIR)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}, out_dir / RM_HEAD_FILE)
        # Written last: a directory with this file is complete.
        config = {"format": RM_FORMAT, "max_len": self.max_len, "hidden_size": self.backbone.config.hidden_size}
        config |= extra or {}
        (out_dir / RM_CONFIG_FILE).write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, path: Path, *, device: str | torch.device = "cpu", quantize: Quantize | None = None) -> RewardModel:
        """A reward model saved by `save`, in eval mode, for scoring.

        `quantize` None: fp32 weights. "8bit"/"4bit": the backbone's Linear layers quantized as
        loaded (`_load_quantized_backbone`); embeddings, norms and the head stay in full precision.
        """
        path = Path(path)
        device = torch.device(device)
        config = check_reward_model_dir(path)
        if quantize is None:
            backbone = AutoModel.from_pretrained(path / RM_BACKBONE_DIR, dtype=torch.float32)
        else:
            backbone = _load_quantized_backbone(path / RM_BACKBONE_DIR, device, quantize)
        tokenizer = AutoTokenizer.from_pretrained(path / RM_BACKBONE_DIR)
        model = cls(backbone, tokenizer, max_len=config["max_len"])  # the fp32 head goes to the backbone's device
        model.head.load_state_dict(load_file(path / RM_HEAD_FILE))
        if quantize is not None and device.type == "cuda":
            # bitsandbytes placed the backbone while loading; moving its 4/8-bit weights with
            # nn.Module.to is not supported.
            return model.eval()
        return model.to(device).eval()


def _load_quantized_backbone(backbone_dir: Path, device: torch.device, quantize: Quantize) -> PreTrainedModel:
    """The saved backbone with its nn.Linear layers quantized.

    CUDA: bitsandbytes through transformers' `quantization_config` -- 8bit is LLM.int8()
    (Dettmers et al. 2022), 4bit is NF4 (Dettmers et al. 2023, QLoRA) computing in bf16; the
    layers left unquantized load in bf16.
    CPU: 8bit is weight-only int8 (`trainer_core.models.int8`: int8 weights with a scale per group
    of 64 columns, multiplied in fp32), as accurate as the weights' rounding and no faster than
    fp32; 4bit has no CPU kernel there and is refused.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize is one of {', '.join(QUANTIZE_CHOICES)} (or None for fp32), got {quantize!r}")
    if device.type == "cuda":
        from transformers import BitsAndBytesConfig

        if quantize == "4bit":
            bnb = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
        else:
            bnb = BitsAndBytesConfig(load_in_8bit=True)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return AutoModel.from_pretrained(
            backbone_dir, quantization_config=bnb, dtype=torch.bfloat16, device_map={"": index}
        )
    if device.type != "cpu":
        raise ValueError(f"a quantized reward model loads on a CUDA GPU or the CPU, not {device.type}")
    if quantize == "4bit":
        raise ValueError(
            "4bit quantization needs a CUDA GPU (bitsandbytes) and this reward model loads on the CPU: use 8bit there"
        )
    backbone = AutoModel.from_pretrained(backbone_dir, dtype=torch.float32)
    quantize_linears_int8(backbone)
    return backbone


# A preference pair as the model reads it: the chosen and the rejected sequence's token ids.
_EncodedPair = tuple[list[int], list[int]]


def _encode_pairs(model: RewardModel, pairs: Sequence[PreferencePair]) -> list[_EncodedPair]:
    return [(model.encode(p.prompt, p.chosen), model.encode(p.prompt, p.rejected)) for p in pairs]


def _pair_loss(model: RewardModel, pairs: Sequence[_EncodedPair], packed: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry loss of `pairs`, chosen and rejected scored in one forward pass."""
    rewards = model([c for c, _ in pairs] + [r for _, r in pairs], packed=packed)  # chosen, then rejected
    return bradley_terry_loss(rewards[: len(pairs)], rewards[len(pairs) :])


def evaluate_reward_model(
    model: RewardModel, pairs: Sequence[PreferencePair], *, micro_batch_size: int = 8, packed: bool = True
) -> dict[str, float]:
    """`rm/loss`, `rm/accuracy` and `rm/margin` over `pairs`, without updating the model."""
    if not pairs:
        raise ValueError("evaluate_reward_model needs at least one pair")
    encoded = _encode_pairs(model, pairs)
    totals = {"rm/loss": 0.0, "rm/accuracy": 0.0, "rm/margin": 0.0}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(encoded), micro_batch_size):
                micro = encoded[start : start + micro_batch_size]
                loss, metrics = _pair_loss(model, micro, packed)
                for key, value in {"rm/loss": loss, **metrics}.items():
                    totals[key] += value.item() * len(micro)
    finally:
        model.train(was_training)
    return {key: value / len(pairs) for key, value in totals.items()}


def train_reward_model(
    model: RewardModel,
    pairs: Sequence[PreferencePair],
    cfg: RewardModelConfig,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train `model` in place on `pairs`; returns `rm/loss`, `rm/accuracy`, `rm/margin` and
    `rm/grad_norm` averaged over the last epoch's optimizer steps (training-set figures), and
    perf metrics.

    `on_step(step, metrics)` is called after every optimizer step (for progress output).
    """
    if not pairs:
        raise ValueError("train_reward_model needs at least one preference pair")
    start_time = time.perf_counter()

    def micro_loss(micro: Sequence[_EncodedPair], batch: Sequence[_EncodedPair]) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = _pair_loss(model, micro, cfg.packed)
        # Weighted by the micro-batch's share of pairs: the accumulated gradient is that of the
        # mean over the step's pairs.
        share = len(micro) / len(batch)
        return loss * share, {key: share * value for key, value in {"rm/loss": loss.detach(), **metrics}.items()}

    settings = FitSettings(
        learning_rate=cfg.learning_rate,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
    )
    result = fit(model, _encode_pairs(model, pairs), micro_loss, settings, prefix="rm", on_step=on_step)
    return {
        **mean_metrics(result.last_epoch),
        "rm/steps": float(result.steps),
        "data/pairs": float(len(pairs)),
        "perf/seconds": time.perf_counter() - start_time,
    }


def run_train_rm(
    model: str,
    data: Path,
    out_dir: Path,
    cfg: RewardModelConfig,
    *,
    cache_dir: Path,
    eval_data: Path | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train a reward model on `model`'s backbone (a builtin name, model directory or .gguf file)
    from the JSONL preference file `data`, save it to `out_dir`, and return its metrics, with
    `eval/rm/*` figures on `eval_data` when given. A run names `out_dir` in a reward term
    ``{"fn": "reward_model", "path": ...}``.

    `out_dir/reward_model.json` also records the config, data and metrics.
    """
    pairs = read_preference_pairs(data)
    eval_pairs = read_preference_pairs(eval_data) if eval_data is not None else None
    rm = RewardModel.from_policy(load_policy(model, cache_dir=cache_dir), max_len=cfg.max_len, seed=cfg.seed)
    metrics = train_reward_model(rm, pairs, cfg, on_step=on_step)
    if eval_pairs is not None:
        metrics |= {f"eval/{k}": v for k, v in evaluate_reward_model(rm, eval_pairs, packed=cfg.packed).items()}
    rm.save(out_dir, extra={"base_model": str(model), "data": str(data), "config": asdict(cfg), "metrics": metrics})
    return metrics
