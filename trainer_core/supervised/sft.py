"""Supervised fine-tuning on (prompt, response) pairs.

The loss is the token-mean negative log-likelihood of the response tokens (and the end-of-turn
token that closes each response); prompt tokens are context only. A micro-batch is packed into
one row without padding: each sequence restarts its `position_ids` at 0, from which transformers
builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`), so no token
attends across a sequence boundary. The LM head runs on response positions only, in chunks
(`logprobs.chunked_logprobs`), so no `(tokens x vocab)` fp32 tensor exists.

The sequence encoding and packed batches here are shared with `reward_model`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer_core.logprobs import chunked_logprobs
from trainer_core.models.loading import Policy, encode_prompt, load_policy, save_policy, stop_token_ids
from trainer_core.models.lora import causal_lm
from trainer_core.supervised.fit import FitSettings, fit, mean_metrics

SFT_CONFIG_FILE = "sft.json"  # written next to the fine-tuned policy: config and final metrics


@dataclass
class SFTConfig:
    """Hyper-parameters of `train_sft`."""

    learning_rate: float = 1e-5  # AdamW learning rate
    epochs: int = 1  # passes over the examples
    batch_size: int = 16  # examples per optimizer step
    micro_batch_size: int = 4  # examples per forward/backward (gradient accumulation)
    max_len: int = 1024  # prompt + response tokens kept; the response's end is cut beyond it
    warmup_steps: int = 0  # optimizer steps of linear learning-rate warmup, then constant
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    max_grad_norm: float = 1.0  # gradient-norm clip per optimizer step
    seed: int = 0  # seeds the shuffling of examples each epoch
    packed: bool = True  # micro-batches as one padding-free row (needs a model masked by transformers.masking_utils: Llama, Qwen2, Mistral, Gemma...); False = right-padded rows
    autocast_bf16: bool = False  # forward passes under bf16 autocast; weights and optimizer stay fp32
    logprob_chunk_tokens: int = 1024  # response tokens per LM-head chunk: bounds the fp32 (tokens x vocab) logits

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if min(self.epochs, self.batch_size, self.micro_batch_size, self.logprob_chunk_tokens) < 1:
            raise ValueError("epochs, batch_size, micro_batch_size and logprob_chunk_tokens must be >= 1")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 (a prompt token and a response token), got {self.max_len}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class SFTExample:
    """One line of an SFT data set: ``{"prompt": ..., "response": ...}``."""

    prompt: str
    response: str


def read_jsonl(path: Path, fields: Sequence[str]) -> list[dict[str, str]]:
    """The objects of a JSONL file, each required to hold non-empty strings under `fields`;
    a ValueError names the first bad line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not JSON: {e}") from None
            if not isinstance(record, dict) or not all(isinstance(record.get(k), str) and record[k] for k in fields):
                keys = ", ".join(f'"{k}": ...' for k in fields)
                raise ValueError(f"{path} line {number} is not a {{{keys}}} object of non-empty strings")
            records.append({k: record[k] for k in fields})
    if not records:
        raise ValueError(f"{path} holds no examples")
    return records


def read_sft_examples(path: Path) -> list[SFTExample]:
    """SFT examples from a JSONL file of ``{"prompt": ..., "response": ...}`` objects."""
    return [SFTExample(**r) for r in read_jsonl(path, ("prompt", "response"))]


def end_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that closes a reply: the end-of-turn token the chat template writes after an
    assistant message (e.g. `<|im_end|>`), else eos. Generation stops on it (`stop_token_ids`)."""
    stops = stop_token_ids(tokenizer)
    if tokenizer.chat_template and stops:
        marker = "\x00reply\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], tokenize=False
        )
        tail = rendered[rendered.rindex(marker) + len(marker) :]
        found = [(tail.find(tok), i) for i, tok in zip(stops, tokenizer.convert_ids_to_tokens(stops), strict=True)]
        found = [(at, i) for at, i in found if at >= 0]
        if found:
            return min(found)[1]  # the first one written after the reply
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither an eos token nor a chat template's end-of-turn token")
    return tokenizer.eos_token_id


def encode_pair(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Prompt ids as generation sees them (`encode_prompt`) and the response's ids closed by
    `end_token_id`: the sequence a policy should produce, and the one a reward model reads."""
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    return encode_prompt(tokenizer, prompt), [*response_ids, end_token_id(tokenizer)]


@dataclass
class TokenBatch:
    """Sequences laid out for one forward pass: packed into one row, or right-padded rows."""

    input_ids: Tensor  # (rows, row_len)
    position_ids: Tensor  # (rows, row_len); restarts at 0 for each packed sequence
    attention_mask: Tensor | None  # (rows, row_len) when padded; None when packed (position_ids say it)
    starts: list[int]  # flat index (into rows * row_len) of each sequence's first token
    lengths: list[int]  # tokens of each sequence

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]], *, packed: bool) -> TokenBatch:
        lengths = [len(s) for s in sequences]
        if not sequences or min(lengths) < 1:
            raise ValueError("a batch needs at least one sequence, each of at least one token")
        if packed:
            input_ids = torch.tensor([[t for s in sequences for t in s]])  # (1, total)
            position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            return cls(input_ids, position_ids, None, starts, lengths)
        row_len = max(lengths)
        input_ids = torch.zeros(len(sequences), row_len, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), row_len, dtype=torch.long)
        for row, s in enumerate(sequences):
            input_ids[row, : len(s)] = torch.tensor(s)
            attention_mask[row, : len(s)] = 1
        position_ids = torch.arange(row_len).expand(len(sequences), -1)
        return cls(input_ids, position_ids, attention_mask, [row * row_len for row in range(len(sequences))], lengths)

    def hidden_states(self, backbone: nn.Module, *, autocast_bf16: bool = False) -> Tensor:
        """Last hidden states of a transformers base model (`model.base_model`), flattened to
        `(rows * row_len, hidden)`; index them with `starts`."""
        device = next(backbone.parameters()).device
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        # bf16 autocast is for accelerators and CPUs with bf16 units; elsewhere it is emulated and slow.
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            # use_cache=False: with a cache, transformers would not derive the packed mask.
            hidden = backbone(
                input_ids=self.input_ids.to(device),
                position_ids=self.position_ids.to(device),
                attention_mask=mask,
                use_cache=False,
            ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])  # (rows * row_len, hidden)


@dataclass(frozen=True)
class _Encoded:
    ids: list[int]
    n_prompt: int  # the first n_prompt ids are context; the rest are trained on


def _encode_examples(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[SFTExample], max_len: int
) -> tuple[list[_Encoded], int, int]:
    """Encoded examples, and how many were truncated (response end cut at max_len) and dropped
    (no room for a response token after the prompt)."""
    encoded, truncated, dropped = [], 0, 0
    for ex in examples:
        prompt_ids, response_ids = encode_pair(tokenizer, ex.prompt, ex.response)
        if not prompt_ids or len(prompt_ids) >= max_len:
            dropped += 1
            continue
        ids = [*prompt_ids, *response_ids]
        truncated += len(ids) > max_len
        encoded.append(_Encoded(ids[:max_len], len(prompt_ids)))
    return encoded, truncated, dropped


def _response_nll(model: nn.Module, encoded: Sequence[_Encoded], cfg: SFTConfig) -> Tensor:
    """Negative log-likelihood of every response token of `encoded`, flattened `(n_tokens,)`."""
    batch = TokenBatch.build([e.ids for e in encoded], packed=cfg.packed)
    # causal_lm unwraps a LoRA (peft) policy, whose own base_model is the adapter wrapper.
    hidden = batch.hidden_states(causal_lm(model).base_model, autocast_bf16=cfg.autocast_bf16)
    # Position t's output predicts token t + 1: response token j of a sequence starting at s is
    # predicted at s + j - 1, for j in [n_prompt, len).
    positions = torch.tensor(
        [s + j - 1 for s, e in zip(batch.starts, encoded, strict=True) for j in range(e.n_prompt, len(e.ids))],
        device=hidden.device,
    )
    targets = batch.input_ids.to(hidden.device).flatten()[positions + 1]
    return -chunked_logprobs(model, hidden[positions], targets, chunk_tokens=cfg.logprob_chunk_tokens)


def sft_loss(policy: Policy, examples: Sequence[SFTExample], cfg: SFTConfig) -> float:
    """Token-mean NLL of the examples' responses under the policy, without updating it."""
    encoded, _, _ = _encode_examples(policy.tokenizer, examples, cfg.max_len)
    if not encoded:
        raise ValueError("no example fits max_len")
    total, n_tokens = 0.0, 0
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(encoded), cfg.micro_batch_size):
                nll = _response_nll(policy.model, encoded[start : start + cfg.micro_batch_size], cfg)
                total += nll.sum().item()
                n_tokens += nll.numel()
    finally:
        policy.model.train(was_training)
    return total / n_tokens


def train_sft(
    policy: Policy,
    examples: Sequence[SFTExample],
    cfg: SFTConfig,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Fine-tune `policy.model` in place on `examples`; returns the metrics of the run.

    `sft/loss` and `sft/grad_norm` are means over the last epoch's optimizer steps (each step's
    loss is its token-mean NLL); `on_step(step, metrics)` is called after every optimizer step
    (for progress output). Parameters with `requires_grad=False` (a frozen base under LoRA) are
    left alone.
    """
    start_time = time.perf_counter()
    encoded, truncated, dropped = _encode_examples(policy.tokenizer, examples, cfg.max_len)
    if not encoded:
        raise ValueError(
            f"none of the {len(examples)} examples leaves room for a response within max_len={cfg.max_len}"
        )

    def micro_loss(micro: Sequence[_Encoded], batch: Sequence[_Encoded]) -> tuple[Tensor, dict[str, Tensor]]:
        # Summed over the micro-batch and divided by the whole step's response tokens: the
        # accumulated gradient is that of the token-mean over the step.
        loss = _response_nll(policy.model, micro, cfg).sum() / sum(len(e.ids) - e.n_prompt for e in batch)
        return loss, {"sft/loss": loss.detach()}

    settings = FitSettings(
        learning_rate=cfg.learning_rate,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        warmup_steps=cfg.warmup_steps,
    )
    result = fit(policy.model, encoded, micro_loss, settings, prefix="sft", on_step=on_step)
    seconds = time.perf_counter() - start_time
    n_tokens = cfg.epochs * sum(len(e.ids) for e in encoded)
    return {
        **mean_metrics(result.last_epoch),
        "sft/steps": float(result.steps),
        "data/examples": float(len(encoded)),
        "data/truncated": float(truncated),
        "data/dropped": float(dropped),
        "perf/tokens": float(n_tokens),
        "perf/seconds": seconds,
        "perf/tokens_per_s": n_tokens / seconds,
    }


def run_sft(
    model: str,
    data: Path,
    out_dir: Path,
    cfg: SFTConfig,
    *,
    cache_dir: Path,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Fine-tune `model` (a builtin name, model directory or .gguf file) on the JSONL file `data`
    and save the result to `out_dir`, a policy directory any run can name as its `model`.

    `out_dir/sft.json` records the config and the metrics.
    """
    examples = read_sft_examples(data)
    policy = load_policy(model, cache_dir=cache_dir)
    metrics = train_sft(policy, examples, cfg, on_step=on_step)
    out_dir = Path(out_dir)
    save_policy(policy, out_dir)
    record = {"base_model": str(model), "data": str(data), "config": asdict(cfg), "metrics": metrics}
    (out_dir / SFT_CONFIG_FILE).write_text(json.dumps(record, indent=2))
    return metrics
