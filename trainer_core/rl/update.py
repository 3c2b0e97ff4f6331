"""One RL update (GRPO or PPO) of a policy on a batch of rollout samples.

Composes the math in `algos`: score the batch (reference log-probs, critic values, proximal
log-probs), estimate advantages, then for each epoch and mini-batch accumulate micro-batch
gradients of the clipped surrogate (+ KL-to-reference, + value loss) and take one optimizer
step. How gradients become a step is a `Strategy`: one process here, FSDP2 or DeepSpeed ZeRO
across data-parallel ranks in `trainer_core.rl.distributed`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel

from contracts.training import Algorithm, KLMode, OffPolicy, TrainConfig
from trainer_core.algos import (
    AdaptiveKLController,
    FixedKLController,
    LossAggMode,
    aggregate_loss,
    compute_advantages,
    decoupled_policy_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from trainer_core.engines.hf import cache_kwarg, distinct_prompts, left_pad
from trainer_core.models.lora import causal_lm, reference_policy
from trainer_core.memory import (
    available_memory_gb,
    decoder_layers,
    plan_micro_batch,
    plan_micro_batches,
    probe_micro_batch,
    release_during_backward,
    release_freed_memory,
)
from contracts.samples import Sample


log = logging.getLogger(__name__)
_T = TypeVar("_T")


class ValueHead(nn.Module):
    """PPO critic: Linear(hidden, 1) on a last hidden state.

    Shared (the default): on the policy's own hidden states, detached, so the critic's loss
    never disturbs the actor and costs one linear layer. Separate: on the hidden states of its
    own `backbone` (a causal LM, typically a copy of the base model), which it trains too: a
    critic with its own features, at the cost of a second model's weights and passes.
    """

    def __init__(self, hidden_size: int, backbone: PreTrainedModel | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.linear = nn.Linear(hidden_size, 1)
        # Start by predicting 0: the first advantages are then plain discounted returns,
        # not returns minus the noise of a random critic.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """`(batch, seq, hidden)` -> values `(batch, seq)`."""
        if self.backbone is None:
            hidden_states = hidden_states.detach()
        return self.linear(hidden_states.float()).squeeze(-1)


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, value_head: ValueHead | None = None
) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters and the value head's."""
    params = [p for p in model.parameters() if p.requires_grad]
    if value_head is not None:
        params += list(value_head.parameters())
    # No weight decay: an RL update is a small nudge from a pretrained policy, and decay
    # would pull the weights toward 0 for no reward.
    device = next(model.parameters()).device
    # The fused kernel does the whole update in one pass (~5x faster on CPU than the default).
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0, fused=fused)


class Strategy(Protocol):
    """How accumulated micro-batch gradients become an optimizer step, on one process or on
    `world_size` data-parallel ranks that each hold a share of the batch.

    Gradients are averaged over ranks (as DDP, FSDP and DeepSpeed do); `train_on_batch` scales
    each rank's loss so that the average is the gradient of the loss over the whole batch.
    """

    rank: int
    world_size: int

    def forward(self, fn: Callable[[], _T]) -> _T:
        """`fn()`, one forward pass of the policy (a micro-batch's loss, or a no-grad scoring
        pass), run where the wrapped model sees it: FSDP2 gathers its root's parameters in the
        root's forward, and DeepSpeed's engine counts its micro-steps in its own forward."""
        ...

    def reference_forward(self, fn: Callable[[], _T]) -> _T:
        """`fn()`, one forward pass of the reference policy, as `forward` runs the policy's (a
        strategy may hold the reference model sharded too)."""
        ...

    def all_reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        """`value` reduced over ranks with "sum" or "max" (a new tensor; itself on one process)."""
        ...

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradients of one micro-batch's loss."""
        ...

    def step(self) -> Tensor:
        """Clip, apply and zero the accumulated gradients; returns the actor's gradient norm."""
        ...


class LocalStrategy:
    """A `Strategy` for one process: plain backward, gradient clipping, one optimizer."""

    rank = 0
    world_size = 1

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        actor: Sequence[nn.Parameter],
        critic: Sequence[nn.Parameter] = (),
        max_grad_norm: float = 1.0,
    ) -> None:
        self.optimizer = optimizer
        self._actor, self._critic = list(actor), list(critic)
        self._max_grad_norm = max_grad_norm

    def forward(self, fn: Callable[[], _T]) -> _T:
        return fn()

    def reference_forward(self, fn: Callable[[], _T]) -> _T:
        return fn()

    def all_reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        return value.clone()

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> Tensor:
        grad_norm = nn.utils.clip_grad_norm_(self._actor, self._max_grad_norm)
        if self._critic:
            # Clipped apart from the actor, so a large critic gradient cannot shrink its step.
            nn.utils.clip_grad_norm_(self._critic, self._max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def train_on_batch(
    model: nn.Module,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer | Strategy,
    *,
    ref_model: nn.Module | None = None,
    value_head: ValueHead | None = None,
    kl_controller: FixedKLController | AdaptiveKLController | None = None,
) -> dict[str, float]:
    """Update `model` (and, for PPO, `value_head`) on `samples`; returns metrics averaged over
    optimizer steps.

    `model` is a transformers causal LM or a peft LoRA model over one; `optimizer` is a torch
    optimizer (one process) or a `Strategy` (data-parallel: `samples` are this rank's share, in
    whole GRPO groups, the same number on every rank). The reference policy for `kl_coef` is
    `ref_model`, or a LoRA model's base weights. `kl_controller` (fixed or adaptive), when
    given, supplies the KL coefficient and is updated with this batch's KL. `perf/tokens`
    counts the batch's prompt and response tokens.
    """
    algorithm = cfg.algorithm
    if not samples:
        raise ValueError("train_on_batch needs at least one sample")
    if cfg.micro_batch == 0:
        raise ValueError("micro_batch 0 means auto: set it to auto_micro_batch(model, samples, cfg) first")
    critic = value_head if algorithm is Algorithm.PPO else None
    if algorithm is Algorithm.PPO and critic is None:
        raise ValueError("ppo needs a value_head")
    strategy = (
        LocalStrategy(
            optimizer,
            [p for p in model.parameters() if p.requires_grad],
            list(critic.parameters()) if critic is not None else [],
            cfg.max_grad_norm,
        )
        if isinstance(optimizer, torch.optim.Optimizer)
        else optimizer
    )
    kl_coef = kl_controller.value if kl_controller is not None else cfg.kl_coef
    start = time.perf_counter()
    device = next(model.parameters()).device
    response_len = max(len(s.response_ids) for s in samples)
    mini_size = (cfg.mini_batch or len(samples) * strategy.world_size) // strategy.world_size
    if mini_size < 1:
        raise ValueError(f"mini_batch {cfg.mini_batch} is smaller than the {strategy.world_size} ranks")

    model.eval()  # scored as generation sampled: no dropout
    batch = _prepare(model, samples, response_len, cfg, kl_coef, algorithm, ref_model, critic, strategy)
    with _training_mode(model, cfg.gradient_checkpointing):
        totals: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=device))
        grad_norms = []
        for _ in range(cfg.epochs):
            for mb_start in range(0, len(samples), mini_size):
                mini = range(mb_start, min(mb_start + mini_size, len(samples)))
                # What each micro-batch's loss is averaged over: tokens or sequences (loss_agg),
                # summed over ranks, so that the accumulated gradient is that of the whole mini-batch.
                mini_weight = strategy.all_reduce(_weight(batch.mask[mini.start : mini.stop], cfg.loss_agg))
                for micro in _micro_batches(samples, mini, cfg, strategy):
                    rows = batch.rows(micro)
                    micro_samples = [samples[i] for i in micro]
                    loss, step_metrics = strategy.forward(
                        partial(
                            _micro_batch_loss, model, micro_samples, rows, response_len, cfg, kl_coef, critic, strategy
                        )
                    )
                    share = _weight(rows.mask, cfg.loss_agg) / mini_weight
                    release_freed_memory()
                    strategy.backward(loss * share * strategy.world_size)
                    for key, value in step_metrics.items():
                        totals[key] += share * value
                grad_norms.append(strategy.step())

    release_freed_memory()  # the activations' holes, before the next generation phase
    n_steps = len(grad_norms)
    totals = {key: strategy.all_reduce(value) for key, value in totals.items()}
    # .item() is a device sync; done once, here, rather than per micro-batch.
    metrics = {key: value.item() / n_steps for key, value in totals.items()}
    metrics["actor/grad_norm"] = torch.stack(grad_norms).mean().item()
    metrics.setdefault("actor/kl_ref", 0.0)
    if kl_controller is not None:
        kl_controller.update(metrics["actor/kl_ref"], len(samples) * strategy.world_size)
        metrics["actor/kl_coef"] = kl_controller.value
    # Over the whole batch, all ranks' shares.
    batch_sums = strategy.all_reduce(
        torch.tensor(
            [sum(s.reward for s in samples), sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)],
            dtype=torch.float64,
            device=device,
        )
    ).tolist()
    metrics["reward/mean"] = batch_sums[0] / (len(samples) * strategy.world_size)
    metrics["perf/tokens"] = batch_sums[1]
    metrics["perf/seconds"] = time.perf_counter() - start
    metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / metrics["perf/seconds"]
    return metrics


def auto_micro_batch(
    model: nn.Module, samples: Sequence[Sample], cfg: TrainConfig, *, value_head: ValueHead | None = None
) -> int:
    """A micro-batch size for updating `model` on batches like `samples`: the rule of thumb
    (`memory.plan_micro_batch`) from the device's free memory (available RAM on a CPU), at most
    the batch; on a GPU then the largest of that, half of it, ... whose forward and backward pass
    over the longest samples runs without running out of memory (the gradients are dropped)."""
    device = next(model.parameters()).device
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    start = min(len(samples), plan_micro_batch(device_memory_gb=available_memory_gb(device), params_billions=billions))
    if device.type != "cuda":
        return start
    longest = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True)
    return probe_micro_batch(lambda size: _trial_pass(model, longest[:size], cfg, value_head), start)


def with_auto_micro_batch(
    cfg: TrainConfig,
    model: nn.Module,
    samples: Sequence[Sample],
    *,
    value_head: ValueHead | None = None,
    agree: Callable[[int], int] = lambda size: size,
) -> TrainConfig:
    """`cfg` as it is, or, when its micro_batch is 0 (auto), with `auto_micro_batch`'s size
    for `samples`, passed through `agree` (data-parallel ranks take the least of theirs)."""
    if cfg.micro_batch:
        return cfg
    size = agree(auto_micro_batch(model, samples, cfg, value_head=value_head))
    log.info("micro-batches of %d samples (micro_batch 0: planned from free memory)", size)
    return cfg.model_copy(update={"micro_batch": size})


def _trial_pass(model: nn.Module, samples: Sequence[Sample], cfg: TrainConfig, value_head: ValueHead | None) -> None:
    """A forward and backward pass over `samples` as an update makes them; the gradients are
    dropped and no weight changes."""
    try:
        with _training_mode(model, cfg.gradient_checkpointing):
            logprob, values = _forward(model, samples, max(len(s.response_ids) for s in samples), cfg, value_head)
            (logprob.sum() + (values.sum() if values is not None else 0)).backward()
    finally:
        model.zero_grad(set_to_none=True)
        if value_head is not None:
            value_head.zero_grad(set_to_none=True)


@contextmanager
def _training_mode(model: nn.Module, gradient_checkpointing: bool) -> Iterator[None]:
    """Train mode (and gradient checkpointing) for the update; afterwards the model is back in
    eval mode without checkpointing, ready to generate with its KV cache."""
    lm = causal_lm(model)
    if gradient_checkpointing:
        _set_activation_checkpointing(lm, True)
    embeddings = lm.get_input_embeddings()
    head = lm.get_output_embeddings()
    # Tied embeddings (SmolLM2, Llama 3.2, Qwen2.5 small): the LM head's dense gradient reaches
    # the shared weight first, and a sparse lookup gradient is then added into it in place;
    # a dense lookup gradient would be a second vocab x hidden tensor at the peak of the backward.
    tied = isinstance(embeddings, nn.Embedding) and head is not None and head.weight is embeddings.weight
    model.train()
    if tied:
        embeddings.sparse = True
    # Host memory only: on an accelerator the activations live in the device's caching allocator.
    on_host = next(lm.parameters()).device.type == "cpu"
    try:
        with release_during_backward(decoder_layers(lm)) if on_host else nullcontext():
            yield
    finally:
        model.eval()
        if tied:
            embeddings.sparse = False
        if gradient_checkpointing:
            _set_activation_checkpointing(lm, False)


def _set_activation_checkpointing(lm: nn.Module, on: bool) -> None:
    """Switch a transformers model's per-layer activation checkpointing (transformers 5.24
    renamed gradient_checkpointing_* to activation_checkpointing_*; older releases have only
    the former). Non-reentrant checkpointing needs no input that requires grad, so frozen
    embeddings under LoRA are fine, and it nests with the chunked LM head's own checkpoints."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(kwargs) if on else lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_enable(kwargs) if on else lm.gradient_checkpointing_disable()


def _weight(mask: Tensor, loss_agg: str) -> Tensor:
    """What a loss over `mask` `(batch, response_len)` averages over: its real tokens for
    token-mean, its sequences for the sequence-mean modes."""
    if loss_agg == LossAggMode.TOKEN_MEAN:
        return mask.sum()
    return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)


def _micro_batches(
    samples: Sequence[Sample], rows: range, cfg: TrainConfig, strategy: Strategy | None
) -> list[list[int]]:
    """Sample indices of each micro-batch of the mini-batch `rows`: fixed-size runs, or token-budget
    batches of similar lengths; every rank makes as many as the rank that needs the most."""
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in rows]
    plan = lambda min_count: plan_micro_batches(  # noqa: E731
        lengths, max_samples=cfg.micro_batch, max_tokens=cfg.micro_batch_tokens, min_count=min_count
    )
    batches = plan(1)
    if strategy is not None and strategy.world_size > 1:
        most = int(strategy.all_reduce(torch.tensor(float(len(batches))), op="max"))
        batches = plan(most)
    return [[rows.start + i for i in batch] for batch in batches]


@dataclass
class _BatchTensors:
    """Per-token inputs of the losses, each `(batch, response_len)`, fixed for the whole update."""

    mask: Tensor
    old_logprob: Tensor  # what the ratio is clipped around: behaviour or proximal log-probs
    behaviour_logprob: Tensor  # from the samples
    advantages: Tensor
    returns: Tensor
    ref_logprob: Tensor | None  # with a KL loss term
    old_values: Tensor | None  # PPO: the critic's values before the update

    def rows(self, rows: Sequence[int]) -> _BatchTensors:
        """The same tensors for some of the samples."""
        index = torch.tensor(rows, device=self.mask.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return _BatchTensors(
            mask=pick(self.mask),
            old_logprob=pick(self.old_logprob),
            behaviour_logprob=pick(self.behaviour_logprob),
            advantages=pick(self.advantages),
            returns=pick(self.returns),
            ref_logprob=pick(self.ref_logprob),
            old_values=pick(self.old_values),
        )


def _prepare(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    kl_coef: float,
    algorithm: Algorithm,
    ref_model: nn.Module | None,
    critic: ValueHead | None,
    strategy: Strategy,
) -> _BatchTensors:
    """Score the batch before any step (reference and proximal log-probs, old values) and
    estimate advantages."""
    device = next(model.parameters()).device
    mask, behaviour_logprob, token_rewards = _response_tensors(samples, response_len, device)
    with torch.no_grad():
        ref_logprob = None
        if kl_coef > 0:
            with reference_policy(model, ref_model) as ref:
                ref_logprob = _score(ref, samples, response_len, cfg, strategy=strategy, forward=strategy.reference_forward)
        old_values = proximal = None
        if critic is not None or cfg.off_policy == OffPolicy.DECOUPLED:
            proximal, old_values = _score(
                model, samples, response_len, cfg, critic, with_values=True, strategy=strategy
            )
    if ref_logprob is not None and cfg.kl_mode == KLMode.REWARD:
        token_rewards = token_rewards - kl_coef * kl_penalty(behaviour_logprob, ref_logprob, cfg.kl_estimator) * mask
    advantages, returns = _batch_advantages(
        cfg.advantage_estimator,
        token_rewards,
        mask,
        [s.group_id for s in samples],
        old_values,
        cfg,
        strategy,
    )
    return _BatchTensors(
        mask=mask,
        old_logprob=proximal if cfg.off_policy == OffPolicy.DECOUPLED else behaviour_logprob,
        behaviour_logprob=behaviour_logprob,
        advantages=advantages,
        returns=returns,
        ref_logprob=ref_logprob if cfg.kl_mode == KLMode.LOSS else None,
        old_values=old_values,
    )


def _batch_advantages(
    estimator: str,
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: list[str],
    values: Tensor | None,
    cfg: TrainConfig,
    strategy: Strategy,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns `(batch, response_len)` of this rank's samples, as one process
    would compute them over the whole batch.

    Some estimators whiten over the batch (GAE, REINFORCE++): on one rank's share alone their
    mean and variance would differ from the batch's. So each rank gathers every rank's rows
    (one all-reduce of a zero-padded `(world_size * batch, max_response_len)` tensor per input),
    estimates on all of them, and keeps its own. Ranks hold whole groups, so a group's index
    in the gathered batch is its rank's row offset plus its index on that rank.
    """
    kwargs = {"gamma": cfg.gamma, "lam": cfg.lam}
    if strategy.world_size == 1:
        return compute_advantages(
            estimator, token_rewards=token_rewards, response_mask=mask, group_ids=group_ids, values=values, **kwargs
        )
    n, length = mask.shape
    # One all-reduce for the longest response and the smallest and largest share (max of -n).
    longest, most, minus_fewest = strategy.all_reduce(
        torch.tensor([float(length), float(n), -float(n)], device=mask.device), op="max"
    ).tolist()
    if most != -minus_fewest:
        raise ValueError(f"every rank must hold as many samples; this one has {n}, another {int(most)}")
    rows = slice(strategy.rank * n, (strategy.rank + 1) * n)

    def gather(x: Tensor) -> Tensor:  # (n, width <= longest) -> (world_size * n, longest)
        full = x.new_zeros(strategy.world_size * n, int(longest))
        full[rows, : x.shape[1]] = x
        return strategy.all_reduce(full)

    local_index = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    groups = torch.tensor([[strategy.rank * n + local_index[g]] for g in group_ids], dtype=torch.float32)
    advantages, returns = compute_advantages(
        estimator,
        token_rewards=gather(token_rewards),
        response_mask=gather(mask),
        group_ids=[int(g) for g in gather(groups.to(mask.device))[:, 0].tolist()],
        values=gather(values) if values is not None else None,
        **kwargs,
    )
    return advantages[rows, :length], returns[rows, :length]


def _micro_batch_loss(
    model: nn.Module,
    samples: Sequence[Sample],
    mu: _BatchTensors,
    response_len: int,
    cfg: TrainConfig,
    kl_coef: float,
    critic: ValueHead | None,
    strategy: Strategy | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss (clipped surrogate + KL-to-ref + value loss) of one micro-batch, aggregated over
    its own tokens or sequences, and its detached metrics."""
    logprob, values = _forward(model, samples, response_len, cfg, critic, strategy)
    clip_high = cfg.clip_ratio_high or cfg.clip_ratio
    if cfg.off_policy == OffPolicy.DECOUPLED:
        pg_loss, pg_metrics = decoupled_policy_loss(
            logprob, mu.old_logprob, mu.behaviour_logprob, mu.advantages, mu.mask,
            cfg.clip_ratio, clip_high, cfg.is_cap, cfg.loss_agg,
        )
    else:
        pg_loss, pg_metrics = policy_loss(
            logprob, mu.old_logprob, mu.advantages, mu.mask,
            cfg.clip_ratio, clip_high, cfg.dual_clip or None, cfg.loss_agg,
        )
    metrics = {f"actor/{key}": value for key, value in pg_metrics.items()}
    metrics["actor/pg_loss"] = pg_loss.detach()
    actor_loss = pg_loss
    if mu.ref_logprob is not None:
        kl_ref = aggregate_loss(kl_penalty(logprob, mu.ref_logprob, cfg.kl_estimator), mu.mask, cfg.loss_agg)
        actor_loss = actor_loss + kl_coef * kl_ref
        metrics["actor/kl_ref"] = kl_ref.detach()
    metrics["actor/loss"] = actor_loss.detach()
    if critic is None:
        return actor_loss, metrics

    vf_loss, vf_metrics = value_loss(values, mu.old_values, mu.returns, mu.mask, cfg.value_clip, cfg.loss_agg)
    metrics["critic/vf_loss"] = vf_loss.detach()
    metrics["critic/vf_clipfrac"] = vf_metrics["vf_clipfrac"]
    return actor_loss + cfg.vf_coef * vf_loss, metrics


def _response_tensors(
    samples: Sequence[Sample], response_len: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded response mask, behaviour log-probs and token rewards (the sample's scalar
    reward on its last token), each `(batch, response_len)`."""
    mask = torch.zeros(len(samples), response_len)
    old_logprob = torch.zeros(len(samples), response_len)
    token_rewards = torch.zeros(len(samples), response_len)
    for row, sample in enumerate(samples):
        n = len(sample.response_ids)
        if not sample.prompt_ids or n == 0 or len(sample.logprobs) != n:
            raise ValueError(
                f"sample {sample.sample_id}: needs a prompt, a response, and one logprob per "
                "response token"
            )
        mask[row, :n] = 1.0
        old_logprob[row, :n] = torch.tensor(sample.logprobs)
        token_rewards[row, n - 1] = sample.reward
    return mask.to(device), old_logprob.to(device), token_rewards.to(device)


def _score(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHead | None = None,
    *,
    with_values: bool = False,
    strategy: Strategy | None = None,
    forward: Callable[[Callable[[], _T]], _T] | None = None,
) -> Tensor | tuple[Tensor, Tensor | None]:
    """Log-probs under `model` `(batch, response_len)`, and with `with_values` the value head's
    values too (None without one), computed micro-batch by micro-batch (no grad expected);
    each forward pass runs through `forward`, else `strategy.forward` when given, as many on
    every rank."""
    run = forward or (strategy.forward if strategy is not None else (lambda fn: fn()))
    logprobs = torch.zeros(len(samples), response_len, device=next(model.parameters()).device)
    values = torch.zeros_like(logprobs) if value_head is not None else None
    for micro in _micro_batches(samples, range(len(samples)), cfg, strategy):
        micro_samples = [samples[i] for i in micro]
        logprob, value = run(partial(_forward, model, micro_samples, response_len, cfg, value_head, strategy))
        index = torch.tensor(micro, device=logprobs.device)
        logprobs.index_copy_(0, index, logprob)
        if values is not None:
            values.index_copy_(0, index, value)
    return (logprobs, values) if with_values else logprobs


def chunked_logprobs(
    model: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    n_chunks: int = 0,
) -> Tensor:
    """Log-probs of `targets` `(n_tokens,)` from final hidden states `(n_tokens, hidden)`, of
    the logits / `temperature`.

    The LM head runs `chunk_tokens` tokens at a time, and under autograd every chunk but the
    last is checkpointed: its fp32 `(chunk, vocab)` logits are recomputed in the backward pass
    instead of kept, so no `(tokens x vocab)` tensor ever exists (49k vocab x 8k tokens would be
    1.6 GB). The last chunk's logits are kept: the backward pass reaches them first, so
    recomputing them would save no memory. With `n_chunks` the head runs at least that many
    times (the last chunks empty).
    """
    head = causal_lm(model).get_output_embeddings()
    cap = getattr(causal_lm(model).config, "final_logit_softcapping", None)

    def chunk_logprobs(h: Tensor, t: Tensor) -> Tensor:
        logits = head(h).float()
        if cap:  # Gemma 2 soft-caps its logits in forward(); do as it does
            logits = cap * torch.tanh(logits / cap)
        logits = logits / temperature
        # target logit - logsumexp == log_softmax at the target, without a second vocab-sized tensor.
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)

    pieces = []
    size = chunk_tokens
    starts = range(0, max(targets.shape[0], n_chunks * size), size)
    for start in starts:
        h, t = hidden[start : start + size], targets[start : start + size]
        if torch.is_grad_enabled() and start != starts[-1]:
            pieces.append(checkpoint(chunk_logprobs, h, t, use_reentrant=False))
        else:
            pieces.append(chunk_logprobs(h, t))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def _forward(
    model: nn.Module,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHead | None,
    strategy: Strategy | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each sample's response tokens under `model` (logits / temperature, fp32) and,
    with a value head, its values; both `(batch, response_len)`, zero on padding."""
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
        flat = chunked_logprobs(  # (n_tokens,)
            model, hidden, targets,
            chunk_tokens=cfg.logprob_chunk_tokens, temperature=cfg.logit_temperature, n_chunks=n_chunks,
        )
        if value_head is not None and value_head.backbone is not None:
            hidden = _response_hidden_for(value_head.backbone, samples, layout, mask, cfg)
    logprob = torch.zeros(mask.shape, device=device).masked_scatter(mask, flat)  # (batch, response_len)
    values = None
    if value_head is not None:
        values = torch.zeros(mask.shape, device=device).masked_scatter(mask, value_head(hidden))
    return logprob, values


@dataclass
class _Layout:
    """Which prompt each sample continues: `prompts` run once each, `owner[i]` is sample i's."""

    prompts: list[Sequence[int]]
    owner: list[int]
    row_tokens: int  # the longest packed row: a prompt, then the responses of its samples

    @classmethod
    def of(cls, samples: Sequence[Sample], share_prompt_prefix: bool) -> _Layout:
        if share_prompt_prefix:
            prompts, owner = distinct_prompts([s.prompt_ids for s in samples])
        else:
            prompts, owner = [s.prompt_ids for s in samples], list(range(len(samples)))
        rows = [len(p) for p in prompts]
        for sample, prompt in zip(samples, owner, strict=True):
            rows[prompt] += len(sample.response_ids)
        return cls(prompts, owner, max(rows))


def _response_hidden_for(
    lm: PreTrainedModel, samples: Sequence[Sample], layout: _Layout, mask: Tensor, cfg: TrainConfig
) -> Tensor:
    """Final hidden states at the positions that predict the response tokens, flattened sample
    by sample `(n_tokens, hidden)` (the True entries of the response `mask` `(batch,
    response_len)`): from packed rows when they are short enough and the model takes a custom
    mask (SDPA attention), else from padded rows (with shared prompt prefixes when the config
    allows them)."""
    if 0 < layout.row_tokens <= cfg.pack_max_tokens and lm.config._attn_implementation == "sdpa":
        return _response_hidden_packed(lm, samples, layout, mask.device)
    if cfg.share_prompt_prefix and not cfg.gradient_checkpointing:
        return _response_hidden_shared_prefix(lm, samples, layout, mask.shape[1], mask.device)[mask]
    return _response_hidden(lm, samples, mask.shape[1], mask.device)[mask]


def _response_hidden_packed(
    lm: PreTrainedModel, samples: Sequence[Sample], layout: _Layout, device: torch.device
) -> Tensor:
    """`_response_hidden_for` from packed rows: one per prompt of `layout`, holding the prompt
    and then the responses of its samples, under a block mask in which a prompt token sees its
    prompt causally and a response token the prompt plus its own response causally.

    What each token attends to and its position are those of the padded passes, so the hidden
    states are theirs; a prompt shared by a group runs once, and only the rows' tails are
    padding. The mask is dense `(row, row)`, so rows are kept to `TrainConfig.pack_max_tokens`.
    """
    ids, position, mask, picks = _packed_rows(samples, layout)
    hidden = lm.base_model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),  # (rows, 1, width, width)
        position_ids=position.to(device),
        use_cache=False,
    ).last_hidden_state
    return hidden.flatten(0, 1)[picks.to(device)]


def _packed_rows(samples: Sequence[Sample], layout: _Layout) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed rows of `_response_hidden_packed`: token ids and positions `(rows, width)`, the
    mask `(rows, 1, width, width)`, and for each response token, sample by sample, the index in
    the flattened rows of the token that predicts it (its prompt's last token for the first)."""
    members: list[list[int]] = [[] for _ in layout.prompts]
    for i, prompt in enumerate(layout.owner):
        members[prompt].append(i)
    width = layout.row_tokens
    ids = torch.zeros(len(members), width, dtype=torch.long)
    position = torch.zeros(len(members), width, dtype=torch.long)
    # Padding attends to itself only (a row of no keys would be NaN); nothing attends to it.
    mask = torch.eye(width, dtype=torch.bool).repeat(len(members), 1, 1, 1)
    picks: list[list[int]] = [[] for _ in samples]
    for row, (prompt, group) in enumerate(zip(layout.prompts, members, strict=True)):
        n_prompt = len(prompt)
        ids[row, :n_prompt] = torch.tensor(prompt)
        position[row, :n_prompt] = torch.arange(n_prompt)
        mask[row, 0, :n_prompt, :n_prompt] = torch.ones(n_prompt, n_prompt, dtype=torch.bool).tril()
        start = n_prompt
        for i in group:
            response = samples[i].response_ids
            end = start + len(response)
            ids[row, start:end] = torch.tensor(response)
            position[row, start:end] = torch.arange(n_prompt, n_prompt + len(response))
            mask[row, 0, start:end, :n_prompt] = True
            mask[row, 0, start:end, start:end] = torch.ones(len(response), len(response), dtype=torch.bool).tril()
            # Response token 0 is predicted by the prompt's last token, token t by token t - 1.
            picks[i] = [row * width + n_prompt - 1, *range(row * width + start, row * width + end - 1)]
            start = end
    return ids, position, mask, torch.tensor([p for sample_picks in picks for p in sample_picks])


def _response_hidden(
    lm: PreTrainedModel, samples: Sequence[Sample], response_len: int, device: torch.device
) -> Tensor:
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
