"""What a policy assigns to the response tokens of samples: log-probs (of logits / temperature,
fp32), the value head's values, and optionally the entropy of each token's distribution, from
one forward pass over a micro-batch.

The backbone runs each prompt and its samples' responses as packed rows under a block mask, or
as padded rows (each distinct prompt once, on a KV cache, when the config allows); the LM head
then runs on the real response tokens only, in checkpointed chunks (`chunked_lm_head`), so no
`(tokens x vocab)` tensor exists beyond one chunk. Used by the RL update (`rl/`) and by SFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.engines.hf import cache_kwarg, distinct_prompts, left_pad
from trainer_core.models.lora import causal_lm
from trainer_core.vocab_scores import logprob_and_entropy, target_logprob


class ValueHeadLike(Protocol):
    """What `response_scores` needs of a value head (`rl.critic.ValueHead`): hidden states
    `(n_tokens, hidden)` to values `(n_tokens,)`, and the backbone whose hidden states it reads
    (None: the policy's)."""

    @property
    def backbone(self) -> PreTrainedModel | None: ...

    def __call__(self, hidden_states: Tensor) -> Tensor: ...


class RanksLike(Protocol):
    """What `response_scores` needs of a training strategy (`rl.strategy.Strategy`): how many
    data-parallel ranks there are, and a reduction over them."""

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, value: Tensor, op: str = "sum") -> Tensor: ...


class TokenScores(NamedTuple):
    """A micro-batch's per-token scores, each `(batch, response_len)`, zero on padding."""

    logprob: Tensor
    values: Tensor | None  # with a value head
    entropy: Tensor | None  # with `with_entropy`


def response_scores(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHeadLike | None = None,
    strategy: RanksLike | None = None,
    *,
    with_entropy: bool = False,
) -> TokenScores:
    """Log-probs of each sample's response tokens under `model` (logits / temperature, fp32),
    with a value head its values, and `with_entropy` the entropy of the policy's distribution at
    each response token (of the same logits); all `(batch, response_len)`, zero on padding."""
    device = next(model.parameters()).device
    lm = causal_lm(model)
    layout = _Layout.of(samples, cfg.share_prompt_prefix)
    n_chunks = -(-sum(len(s.response_ids) for s in samples) // cfg.logprob_chunk_tokens)
    if strategy is not None and strategy.world_size > 1:
        # Every rank calls the LM head and the backbone as many times: ZeRO-3 gathers a module's
        # parameters at each call, a collective that all ranks must make in the same order.
        agreed = strategy.all_reduce(torch.tensor([float(n_chunks), float(layout.row_tokens)]), op="max")
        n_chunks, layout.row_tokens = int(agreed[0]), int(agreed[1])
    targets = torch.tensor([t for s in samples for t in s.response_ids], device=device)  # (n_tokens,)
    lengths = torch.tensor([len(s.response_ids) for s in samples], device=device)
    mask = torch.arange(response_len, device=device) < lengths[:, None]  # (batch, response_len)

    # bf16 autocast is for accelerators and CPUs with bf16 units (AVX512-BF16/AMX): elsewhere
    # it is emulated and ~15x slower.
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        hidden = _response_hidden_for(lm, samples, layout, mask, cfg)
        # The LM head runs on the real response tokens only, flattened: the prompt's logits, a
        # (prompt_len x vocab) tensor per sample, and padding never reach it.
        flat, flat_entropy = chunked_lm_head(  # (n_tokens,) each
            model,
            hidden,
            targets,
            chunk_tokens=cfg.logprob_chunk_tokens,
            temperature=cfg.logit_temperature,
            n_chunks=n_chunks,
            with_entropy=with_entropy,
        )
        if value_head is not None and value_head.backbone is not None:
            hidden = _response_hidden_for(value_head.backbone, samples, layout, mask, cfg)

    def unflatten(flat: Tensor) -> Tensor:  # (n_tokens,) -> (batch, response_len)
        return torch.zeros(mask.shape, device=device).masked_scatter(mask, flat)

    return TokenScores(
        logprob=unflatten(flat),
        values=unflatten(value_head(hidden)) if value_head is not None else None,
        entropy=unflatten(flat_entropy) if flat_entropy is not None else None,
    )


def chunked_lm_head(
    model: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    n_chunks: int = 0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` `(n_tokens,)` from final hidden states `(n_tokens, hidden)`, of
    the logits / `temperature`; and `with_entropy` the entropy of each token's distribution over
    the vocabulary (of the same logits), else None.

    The LM head runs `chunk_tokens` tokens at a time, and under autograd every chunk but the
    last is checkpointed: its fp32 `(chunk, vocab)` logits are recomputed in the backward pass
    instead of kept, so no `(tokens x vocab)` tensor ever exists (49k vocab x 8k tokens would be
    1.6 GB); the entropy is taken inside the chunk too. The last chunk's logits are kept: the
    backward pass reaches them first, so recomputing them would save no memory. With `n_chunks`
    the head runs at least that many times (the last chunks empty).
    """
    head = causal_lm(model).get_output_embeddings()
    cap = getattr(causal_lm(model).config, "final_logit_softcapping", None)

    def chunk_scores(h: Tensor, t: Tensor) -> tuple[Tensor, ...]:
        logits = head(h).float()
        if cap:  # Gemma 2 soft-caps its logits in forward(); do as it does
            logits = cap * torch.tanh(logits / cap)
        if temperature != 1.0:
            logits = logits / temperature
        return logprob_and_entropy(logits, t) if with_entropy else (target_logprob(logits, t),)

    pieces = []
    size = chunk_tokens
    starts = range(0, max(targets.shape[0], n_chunks * size), size)
    for start in starts:
        h, t = hidden[start : start + size], targets[start : start + size]
        if torch.is_grad_enabled() and start != starts[-1]:
            pieces.append(checkpoint(chunk_scores, h, t, use_reentrant=False))
        else:
            pieces.append(chunk_scores(h, t))
    if not pieces:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logprob = torch.cat([piece[0] for piece in pieces])
    return logprob, (torch.cat([piece[1] for piece in pieces]) if with_entropy else None)


def chunked_logprobs(
    model: nn.Module, hidden: Tensor, targets: Tensor, *, chunk_tokens: int, temperature: float = 1.0, n_chunks: int = 0
) -> Tensor:
    """`chunked_lm_head`'s log-probs alone, `(n_tokens,)`."""
    logprob, _ = chunked_lm_head(
        model, hidden, targets, chunk_tokens=chunk_tokens, temperature=temperature, n_chunks=n_chunks
    )
    return logprob


# Packed rows hold several groups up to this many tokens (or the longest group's, if longer):
# below it, the attention a dense row mask wastes across groups costs less than the padding
# a row per group would compute.
PACK_ROW_TOKENS = 512


@dataclass
class _Layout:
    """Which prompt each sample continues: `prompts` run once each, `owner[i]` is sample i's."""

    prompts: list[Sequence[int]]
    owner: list[int]
    group_tokens: list[int]  # per prompt: its tokens and its samples' responses'
    row_tokens: int  # the longest group: what a packed row must hold at least

    @classmethod
    def of(cls, samples: Sequence[Sample], share_prompt_prefix: bool) -> _Layout:
        if share_prompt_prefix:
            prompts, owner = distinct_prompts([s.prompt_ids for s in samples])
        else:
            prompts, owner = [s.prompt_ids for s in samples], list(range(len(samples)))
        groups = [len(p) for p in prompts]
        for sample, prompt in zip(samples, owner, strict=True):
            groups[prompt] += len(sample.response_ids)
        return cls(prompts, owner, groups, max(groups))

    def packed_rows(self, max_tokens: int) -> list[list[int]]:
        """The prompts (groups) of each packed row, first-fit in decreasing length into rows of
        `max(row_tokens, min(PACK_ROW_TOKENS, max_tokens))` tokens."""
        width = max(self.row_tokens, min(PACK_ROW_TOKENS, max_tokens))
        rows: list[list[int]] = []
        free: list[int] = []
        for prompt in sorted(range(len(self.prompts)), key=lambda g: -self.group_tokens[g]):
            row = next((r for r, room in enumerate(free) if room >= self.group_tokens[prompt]), len(rows))
            if row == len(rows):
                rows.append([])
                free.append(width)
            rows[row].append(prompt)
            free[row] -= self.group_tokens[prompt]
        return rows


def _response_hidden_for(
    lm: PreTrainedModel, samples: Sequence[Sample], layout: _Layout, mask: Tensor, cfg: TrainConfig
) -> Tensor:
    """Final hidden states at the positions that predict the response tokens, flattened sample
    by sample `(n_tokens, hidden)` (the True entries of the response `mask` `(batch,
    response_len)`): from packed rows when they are short enough and the model takes a custom
    mask (SDPA attention), else from padded rows (with shared prompt prefixes when the config
    allows them)."""
    if 0 < layout.row_tokens <= cfg.pack_max_tokens and lm.config._attn_implementation == "sdpa":
        return _response_hidden_packed(lm, samples, layout, layout.packed_rows(cfg.pack_max_tokens), mask.device)
    if cfg.share_prompt_prefix and not cfg.gradient_checkpointing:
        return _response_hidden_shared_prefix(lm, samples, layout, mask.shape[1], mask.device)[mask]
    return _response_hidden(lm, samples, mask.shape[1], mask.device)[mask]


def _response_hidden_packed(
    lm: PreTrainedModel, samples: Sequence[Sample], layout: _Layout, rows: list[list[int]], device: torch.device
) -> Tensor:
    """`_response_hidden_for` from packed rows: each of `rows` holds the groups (prompts of
    `layout`) it names, each group its prompt and then the responses of its samples, under a
    block mask in which a prompt token sees its prompt causally and a response token the prompt
    plus its own response causally.

    What each token attends to and its position are those of the padded passes, so the hidden
    states are theirs; a prompt shared by a group runs once, and only the rows' tails are
    padding. The mask is dense `(row, row)`, so rows are kept to `TrainConfig.pack_max_tokens`.
    """
    ids, position, mask, picks = _packed_rows(samples, layout, rows)
    hidden = lm.base_model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),  # (rows, 1, width, width)
        position_ids=position.to(device),
        use_cache=False,
    ).last_hidden_state
    return hidden.flatten(0, 1)[picks.to(device)]


def _packed_rows(
    samples: Sequence[Sample], layout: _Layout, rows: list[list[int]]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed rows of `_response_hidden_packed`: token ids and positions `(rows, width)`, the
    mask `(rows, 1, width, width)`, and for each response token, sample by sample, the index in
    the flattened rows of the token that predicts it (its prompt's last token for the first)."""
    members: list[list[int]] = [[] for _ in layout.prompts]
    for i, prompt in enumerate(layout.owner):
        members[prompt].append(i)
    width = max(sum(layout.group_tokens[g] for g in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    position = torch.zeros(len(rows), width, dtype=torch.long)
    # Padding attends to itself only (a row of no keys would be NaN); nothing attends to it.
    mask = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1, 1)
    picks: list[list[int]] = [[] for _ in samples]
    for row, groups in enumerate(rows):
        start, base = 0, row * width
        for group in groups:
            prompt = layout.prompts[group]
            n_prompt, first = len(prompt), start
            ids[row, start : start + n_prompt] = torch.tensor(prompt)
            position[row, start : start + n_prompt] = torch.arange(n_prompt)
            block = torch.ones(n_prompt, n_prompt, dtype=torch.bool).tril()
            mask[row, 0, start : start + n_prompt, start : start + n_prompt] = block
            start += n_prompt
            for i in members[group]:
                response = samples[i].response_ids
                end = start + len(response)
                ids[row, start:end] = torch.tensor(response)
                position[row, start:end] = torch.arange(n_prompt, n_prompt + len(response))
                mask[row, 0, start:end, first : first + n_prompt] = True
                mask[row, 0, start:end, start:end] = torch.ones(len(response), len(response), dtype=torch.bool).tril()
                # Response token 0 is predicted by the prompt's last token, token t by token t - 1.
                picks[i] = [base + first + n_prompt - 1, *range(base + start, base + end - 1)]
                start = end
    return ids, position, mask, torch.tensor([p for sample_picks in picks for p in sample_picks])


def _response_hidden(lm: PreTrainedModel, samples: Sequence[Sample], response_len: int, device: torch.device) -> Tensor:
    """Final hidden states at the positions that predict each response token, `(batch,
    response_len, hidden)`, from one pass over the right-padded prompt + response sequences."""
    seq_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), seq_len, dtype=torch.long)
    # positions[i, t]: the sequence position whose output predicts response token t.
    positions = torch.zeros(len(samples), response_len, dtype=torch.long)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_ids + sample.response_ids
        n_prompt, n_response = len(sample.prompt_ids), len(sample.response_ids)
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
        positions[row, :n_response] = torch.arange(n_prompt - 1, n_prompt - 1 + n_response)
    hidden = lm.base_model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).last_hidden_state
    positions = positions.to(device)
    return hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))


def _response_hidden_shared_prefix(
    lm: PreTrainedModel, samples: Sequence[Sample], layout: _Layout, response_len: int, device: torch.device
) -> Tensor:
    """`_response_hidden` with each of `layout.prompts` (the distinct ones) run once.

    The prompts (left-padded) go through the backbone filling a KV cache; the cache rows are then
    repeated for the samples of each prompt, and the right-padded responses run on top of it.
    Attention sees exactly what a full pass sees, and under autograd the gradients of all of a
    prompt's samples flow back into its one prefix computation.
    """
    prompt_ids, prompt_mask = left_pad(layout.prompts, 0, device)  # (n_prompts, prompt_len)
    backbone = lm.base_model
    cache = DynamicCache(config=lm.config)
    cache_arg = {cache_kwarg(backbone): cache}
    prefix = backbone(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp_min(0),
        use_cache=True,
        **cache_arg,
    ).last_hidden_state
    rows = torch.tensor(layout.owner, device=device)
    cache.batch_select_indices(rows)

    response_ids = torch.zeros(len(samples), response_len, dtype=torch.long)
    response_mask = torch.zeros(len(samples), response_len, dtype=torch.long)
    for row, sample in enumerate(samples):
        response_ids[row, : len(sample.response_ids)] = torch.tensor(sample.response_ids)
        response_mask[row, : len(sample.response_ids)] = 1
    prompt_lengths = prompt_mask.sum(-1)[rows]  # (batch,)
    responses = backbone(
        input_ids=response_ids.to(device),
        attention_mask=torch.cat([prompt_mask[rows], response_mask.to(device)], dim=1),
        position_ids=prompt_lengths[:, None] + torch.arange(response_len, device=device),
        use_cache=True,
        **cache_arg,
    ).last_hidden_state
    # Response token 0 is predicted by the prompt's last position (the last column: left padding),
    # token t by response position t - 1.
    return torch.cat([prefix[rows, -1:], responses[:, :-1]], dim=1)
