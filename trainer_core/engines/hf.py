"""Sampling completions, with the behaviour log-probs the trainer's importance ratio needs.

`HFEngine` runs its own loop over a Hugging Face model rather than `model.generate`: asking
`generate` for per-token scores keeps steps x batch x vocab floats, while the loop here keeps
one float per sampled token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from trainer_core.engines import small_batch_linear
from trainer_core.models.loading import stop_token_ids
from trainer_core.models.lora import causal_lm


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    # Behaviour log-prob of each token: log_softmax(logits / temperature) at the chosen token,
    # fp32, before top-p filtering, which is exactly what the trainer recomputes.
    logprobs: list[float]
    finish_reason: str  # "stop" (emitted a stop token, included in token_ids) or "length"


def never() -> bool:
    """The default `should_stop`: generation runs to the end."""
    return False


class GenerationEngine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        should_stop: Callable[[], bool] = never,
    ) -> list[Completion] | None:
        """One completion per prompt, in order; None if `should_stop()` turned True meanwhile."""
        ...


class HFEngine:
    """`GenerationEngine` over a transformers causal LM, with a KV cache and batched prompts.

    `autocast_bf16` runs the model's forward passes under bf16 autocast (the weights stay as
    they are); None, the default, turns it on for CUDA devices with bf16 support, where it is
    safe and several times faster, and off on CPUs, most of which emulate bf16. The recorded
    behaviour log-probs are those of the sampler that drew the tokens, so an update that clips
    or re-weights around them (`algos`) sees the mismatch instead of ignoring it.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, autocast_bf16: bool | None = None
    ) -> None:
        self.tokenizer = tokenizer  # callers encode prompts and decode completions with it
        self._stop_ids = torch.tensor(stop_token_ids(tokenizer))
        # Rows that have finished keep being fed this token; their outputs are discarded.
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._autocast_bf16 = autocast_bf16
        self.set_model(model)

    def set_model(self, model: PreTrainedModel) -> None:
        """Sample from `model` from now on (after a weight reload)."""
        self._model = model
        self._cache_kwarg = cache_kwarg(causal_lm(model).base_model)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        should_stop: Callable[[], bool] = never,
    ) -> list[Completion] | None:
        """One completion per prompt, in order; None if `should_stop()` turned True meanwhile."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # A LoRA policy's adapter layers live inside its causal LM: calling that directly keeps
        # the adapter in use and the weights unmerged (no second copy for generation).
        model = causal_lm(self._model)
        device = next(model.parameters()).device
        generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
        bf16 = self._autocast_bf16
        if bf16 is None:
            bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        with (
            torch.no_grad(),
            _eval_mode(model),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
            small_batch_linear.decoding_linears(model),
        ):
            decoded = self._decode(model, prompts, params, generator, should_stop)
        if decoded is None:
            return None
        tokens, logprobs, lengths, finished = decoded
        return [
            Completion(
                token_ids=tokens[i][:n],
                logprobs=logprobs[i][:n],
                finish_reason="stop" if done else "length",
            )
            for i, (n, done) in enumerate(zip(lengths, finished, strict=True))
        ]

    def _decode(
        self,
        model: PreTrainedModel,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None,
        should_stop: Callable[[], bool],
    ) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]] | None:
        """The decode loop of `generate`: each row's sampled tokens and their log-probs, `(batch,
        steps)` as lists, its length up to and including its stop token, and whether it stopped;
        None if `should_stop()` turned True meanwhile."""
        device = next(model.parameters()).device
        stop_ids = self._stop_ids.to(device)
        # A GRPO group asks for n completions of one prompt: each distinct prompt is prefilled
        # once, and its rows share that prefix's KV cache from the first sampled token on.
        unique, owner = distinct_prompts(prompts)
        input_ids, attention_mask = left_pad(unique, self._pad_id, device)  # (n_unique, prompt_len)
        # Left padding shifts each prompt right; count positions from its first real token.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        batch = len(prompts)
        cache = DynamicCache(config=model.config)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        step_tokens: list[torch.Tensor] = []  # max_new_tokens x (batch,)
        step_logprobs: list[torch.Tensor] = []
        for _ in range(params.max_new_tokens):
            if should_stop():
                return None
            hidden = model.base_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).last_hidden_state
            logits = lm_logits(model, hidden[:, -1])  # (batch, vocab), the last position only
            if len(unique) < batch and logits.shape[0] == len(unique):  # after the prefill
                rows = torch.tensor(owner, device=device)
                cache.batch_select_indices(rows)
                logits, attention_mask, position_ids = logits[rows], attention_mask[rows], position_ids[rows]
            token, logprob = _sample(logits, params, generator)
            token = token.masked_fill(finished, self._pad_id)
            step_tokens.append(token)
            step_logprobs.append(logprob)
            lengths += (~finished).long()
            finished |= torch.isin(token, stop_ids)
            # A CPU-GPU sync per step; it lets a batch of short answers stop early.
            if bool(finished.all()):
                break
            input_ids = token[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
        tokens = torch.stack(step_tokens, dim=1).tolist()  # (batch, steps)
        logprobs = torch.stack(step_logprobs, dim=1).tolist()
        return tokens, logprobs, lengths.tolist(), finished.tolist()


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name of the KV-cache argument of `model.forward`: transformers 5.24 renamed
    past_key_values to cache (the old name warns until 5.40); earlier releases only know
    past_key_values."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def lm_logits(lm: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits `(..., vocab)` of final hidden states `(..., hidden)`, as the model's forward
    computes them (Gemma 2's soft-cap included).

    A plain linear head takes the small-batch kernel where it fits, else W @ h^T: for a few
    rows against a 49k x 576 head on CPU that is ~2.5x faster than F.linear's h @ W^T (27 -> 11
    ms per decode step of SmolLM2), and the kernel halves it again (5 ms).
    """
    head = lm.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])
    if type(head) is torch.nn.Linear and small_batch_linear.fits(flat, head.weight):
        logits = small_batch_linear.linear(flat, head.weight, head.bias)
    elif type(head) is torch.nn.Linear:
        logits = (head.weight @ flat.T).T
        if head.bias is not None:
            logits = logits + head.bias
    else:  # e.g. an adapter on the head
        logits = head(flat)
    logits = logits.float().reshape(*hidden.shape[:-1], -1)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[Sequence[int]], list[int]]:
    """The distinct prompts in first-seen order, and for each prompt the index of its distinct one."""
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], owner


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask, both `(batch, max_prompt_len)`."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` `(batch, vocab)`; returns the tokens and their
    log-probs, both `(batch,)`."""
    if params.temperature == 0:
        token = logits.argmax(dim=-1)
        logprobs = F.log_softmax(logits, dim=-1)
    else:
        logprobs = F.log_softmax(logits / params.temperature, dim=-1)
        token = _draw(_top_p(logprobs.exp(), params.top_p), generator)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of the unnormalised `probs` `(batch, vocab)`, by inverse CDF: one
    uniform draw per row and a binary search in the row's cumulative mass. Same distribution as
    `torch.multinomial`, which draws an exponential variate per vocabulary entry (8% of
    generation time at a 49k vocabulary on CPU)."""
    cdf = probs.cumsum(dim=-1)  # (batch, vocab)
    # In (0, 1]: a draw of exactly 0 would land on a leading zero-probability token.
    u = 1.0 - torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    token = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)
    return token.clamp_max(probs.shape[-1] - 1)  # float rounding at the very top of the CDF


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row of `probs` `(batch, vocab)` outside the smallest set whose
    mass reaches `top_p` (nucleus sampling, Holtzman et al. 2019); rows are not renormalised,
    since multinomial does not need it."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # A token is dropped when the tokens ranked above it already cover top_p; so the most
    # likely token always survives.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the block, then the caller's mode again."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
