"""One RL update (GRPO or PPO) of a policy on a batch of rollout samples.

Composes the math in `algos`: score the batch (reference log-probs, critic values), estimate
advantages, then for each epoch and mini-batch accumulate micro-batch gradients of the clipped
surrogate (+ KL-to-reference, + value loss) and take one optimizer step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer_core.algos import (
    AdvantageEstimator,
    KLEstimator,
    compute_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_loss,
)
from trainer_core.samples import Sample


class Algorithm(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


# GRPO's baseline is its group's mean reward; PPO's is a learned critic, through GAE.
_ADV_ESTIMATOR = {Algorithm.GRPO: AdvantageEstimator.GRPO, Algorithm.PPO: AdvantageEstimator.GAE}


@dataclass
class TrainConfig:
    """Hyper-parameters of `train_on_batch`."""

    algorithm: str = "grpo"  # "grpo" | "ppo"
    learning_rate: float = 1e-5  # AdamW learning rate of the policy (and value head)
    epochs: int = 1  # passes over the batch
    mini_batch_size: int = 0  # samples per optimizer step; 0 = the whole batch
    micro_batch_size: int = 8  # samples per forward/backward (gradient accumulation)
    clip_ratio: float = 0.2  # PPO ratio clip, symmetric: [1 - clip_ratio, 1 + clip_ratio]
    kl_coef: float = 0.0  # k3 KL-to-reference loss term (needs ref_model when > 0)
    temperature: float = 1.0  # must equal the sampling temperature (log-probs are of logits / T)
    gamma: float = 1.0  # PPO discount over response tokens
    lam: float = 0.95  # PPO GAE lambda
    vf_coef: float = 0.5  # weight of the value loss (PPO)
    value_clip: float = 0.2  # how far a value prediction may move from the old one (PPO)
    max_grad_norm: float = 1.0  # gradient-norm clip per optimizer step
    autocast_bf16: bool = False  # forward passes under bf16 autocast; weights and optimizer stay fp32
    adv_estimator: str = ""  # a name in algos.ADV_ESTIMATORS; "" = the algorithm's own (grpo | gae)
    logprob_chunk_tokens: int = 1024  # response tokens per LM-head chunk: bounds the fp32 (tokens x vocab) logits

    def __post_init__(self) -> None:
        Algorithm(self.algorithm)  # raises ValueError naming the bad value
        if self.adv_estimator:
            AdvantageEstimator(self.adv_estimator)
            if (self.adv_estimator == AdvantageEstimator.GAE) != (self.algorithm == Algorithm.PPO):
                raise ValueError("gae advantages need the ppo critic, and ppo uses gae")
        if self.epochs < 1 or self.micro_batch_size < 1 or self.mini_batch_size < 0:
            raise ValueError("epochs and micro_batch_size must be >= 1, mini_batch_size >= 0")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def logit_temperature(self) -> float:
        """Divisor of the logits: greedy sampling (T = 0) records log-probs of the raw logits."""
        return self.temperature or 1.0


class ValueHead(nn.Module):
    """PPO critic: Linear(hidden, 1) on the policy's last hidden state.

    The hidden state is detached, so the critic's loss never disturbs the actor.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        # Start by predicting 0: the first advantages are then plain discounted returns,
        # not returns minus the noise of a random critic.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """`(batch, seq, hidden)` -> values `(batch, seq)`."""
        return self.linear(hidden_states.detach().float()).squeeze(-1)


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


def train_on_batch(
    model: PreTrainedModel,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    *,
    ref_model: PreTrainedModel | None = None,
    value_head: ValueHead | None = None,
) -> dict[str, float]:
    """Update `model` (and, for PPO, `value_head`) on `samples`; returns metrics averaged over
    optimizer steps.

    The importance ratio is taken against the samples' behaviour log-probs, which also
    corrects for samples generated by an older policy version. `perf/tokens` counts the
    batch's prompt and response tokens.
    """
    algorithm = Algorithm(cfg.algorithm)
    if not samples:
        raise ValueError("train_on_batch needs at least one sample")
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("kl_coef > 0 needs a ref_model")
    critic = value_head if algorithm is Algorithm.PPO else None
    if algorithm is Algorithm.PPO and critic is None:
        raise ValueError("ppo needs a value_head")
    start = time.perf_counter()
    device = next(model.parameters()).device
    response_len = max(len(s.response_ids) for s in samples)
    mini_size = cfg.mini_batch_size or len(samples)
    actor_params = [p for p in model.parameters() if p.requires_grad]

    model.train()
    try:
        batch = _prepare(model, samples, response_len, cfg, algorithm, ref_model, critic)
        totals: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=device))
        n_steps = 0
        for _ in range(cfg.epochs):
            for mb_start in range(0, len(samples), mini_size):
                mb_end = min(mb_start + mini_size, len(samples))
                mb_tokens = batch.mask[mb_start:mb_end].sum()
                optimizer.zero_grad(set_to_none=True)
                for mu_start in range(mb_start, mb_end, cfg.micro_batch_size):
                    mu = slice(mu_start, min(mu_start + cfg.micro_batch_size, mb_end))
                    loss, step_metrics = _micro_batch_loss(
                        model, samples[mu], batch.rows(mu), response_len, cfg, critic
                    )
                    # Each micro-batch loss is a token-mean over its own tokens; weighting it by
                    # its share of the mini-batch's tokens makes the accumulated gradient that of
                    # the token-mean over the whole mini-batch.
                    scale = batch.mask[mu].sum() / mb_tokens
                    (loss * scale).backward()
                    for key, value in step_metrics.items():
                        totals[key] += scale * value

                grad_norm = nn.utils.clip_grad_norm_(actor_params, cfg.max_grad_norm)
                totals["actor/grad_norm"] += grad_norm
                if critic is not None:
                    # Clipped apart from the actor, so a large critic gradient cannot shrink
                    # the actor's step.
                    nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
                optimizer.step()
                n_steps += 1
    finally:
        model.eval()

    # .item() is a device sync; done once, here, rather than per micro-batch.
    metrics = {key: value.item() / n_steps for key, value in totals.items()}
    metrics.setdefault("actor/kl_ref", 0.0)
    metrics["reward/mean"] = sum(s.reward for s in samples) / len(samples)
    metrics["perf/tokens"] = float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
    metrics["perf/seconds"] = time.perf_counter() - start
    metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / metrics["perf/seconds"]
    return metrics


@dataclass
class _BatchTensors:
    """Per-token inputs of the losses, each `(batch, response_len)`, fixed for the whole update."""

    mask: Tensor
    old_logprob: Tensor  # behaviour log-probs from the samples
    advantages: Tensor
    returns: Tensor
    ref_logprob: Tensor | None  # with a ref_model
    old_values: Tensor | None  # PPO: the critic's values before the update

    def rows(self, rows: slice) -> _BatchTensors:
        """The same tensors for a slice of the samples."""
        return _BatchTensors(
            mask=self.mask[rows],
            old_logprob=self.old_logprob[rows],
            advantages=self.advantages[rows],
            returns=self.returns[rows],
            ref_logprob=None if self.ref_logprob is None else self.ref_logprob[rows],
            old_values=None if self.old_values is None else self.old_values[rows],
        )


def _prepare(
    model: PreTrainedModel,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    algorithm: Algorithm,
    ref_model: PreTrainedModel | None,
    critic: ValueHead | None,
) -> _BatchTensors:
    """Score the batch before any step (reference log-probs, old values) and estimate advantages."""
    device = next(model.parameters()).device
    mask, old_logprob, token_rewards = _response_tensors(samples, response_len, device)
    with torch.no_grad():
        ref_logprob = (
            _score(ref_model, samples, response_len, cfg) if ref_model is not None else None
        )
        old_values = (
            _score(model, samples, response_len, cfg, critic) if critic is not None else None
        )
    advantages, returns = compute_advantages(
        cfg.adv_estimator or _ADV_ESTIMATOR[algorithm],
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=[s.group_id for s in samples],
        values=old_values,
        gamma=cfg.gamma,
        lam=cfg.lam,
    )
    return _BatchTensors(mask, old_logprob, advantages, returns, ref_logprob, old_values)


def _micro_batch_loss(
    model: PreTrainedModel,
    samples: Sequence[Sample],
    mu: _BatchTensors,
    response_len: int,
    cfg: TrainConfig,
    critic: ValueHead | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss (clipped surrogate + KL-to-ref + value loss) of one micro-batch, token-means over
    its own tokens, and its detached metrics."""
    logprob, values = _forward(model, samples, response_len, cfg, critic)
    pg_loss, pg_metrics = policy_loss(
        logprob, mu.old_logprob, mu.advantages, mu.mask, cfg.clip_ratio, cfg.clip_ratio
    )
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/pg_clipfrac": pg_metrics["pg_clipfrac"],
        "actor/ppo_kl": pg_metrics["ppo_kl"],
    }
    actor_loss = pg_loss
    if mu.ref_logprob is not None:
        kl_ref = masked_mean(kl_penalty(logprob, mu.ref_logprob, KLEstimator.K3), mu.mask)
        actor_loss = actor_loss + cfg.kl_coef * kl_ref
        metrics["actor/kl_ref"] = kl_ref.detach()
    metrics["actor/loss"] = actor_loss.detach()
    if critic is None:
        return actor_loss, metrics

    vf_loss, vf_metrics = value_loss(values, mu.old_values, mu.returns, mu.mask, cfg.value_clip)
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
    model: PreTrainedModel,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHead | None = None,
) -> Tensor:
    """Log-probs under `model`, or the value head's values when given, `(batch, response_len)`,
    computed micro-batch by micro-batch."""
    chunks = []
    for start in range(0, len(samples), cfg.micro_batch_size):
        micro = samples[start : start + cfg.micro_batch_size]
        logprob, values = _forward(model, micro, response_len, cfg, value_head)
        chunks.append(values if value_head is not None else logprob)
    return torch.cat(chunks)


def _chunked_logprobs(model: PreTrainedModel, hidden: Tensor, targets: Tensor, cfg: TrainConfig) -> Tensor:
    """Log-probs of `targets` `(n_tokens,)` from final hidden states `(n_tokens, hidden)`.

    The LM head runs `cfg.logprob_chunk_tokens` tokens at a time, and under autograd each chunk
    is checkpointed: its fp32 `(chunk, vocab)` logits are recomputed in the backward pass instead
    of kept, so no `(tokens x vocab)` tensor ever exists (49k vocab x 8k tokens would be 1.6 GB).
    """
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)

    def chunk_logprobs(h: Tensor, t: Tensor) -> Tensor:
        logits = head(h).float()
        if cap:  # Gemma 2 soft-caps its logits in forward(); do as it does
            logits = cap * torch.tanh(logits / cap)
        logits = logits / cfg.logit_temperature
        # target logit - logsumexp == log_softmax at the target, without a second vocab-sized tensor.
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)

    pieces = []
    for start in range(0, targets.shape[0], cfg.logprob_chunk_tokens):
        h, t = hidden[start : start + cfg.logprob_chunk_tokens], targets[start : start + cfg.logprob_chunk_tokens]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(chunk_logprobs, h, t, use_reentrant=False))
        else:
            pieces.append(chunk_logprobs(h, t))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def _forward(
    model: PreTrainedModel,
    samples: Sequence[Sample],
    response_len: int,
    cfg: TrainConfig,
    value_head: ValueHead | None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each sample's response tokens under `model` (logits / temperature, fp32) and,
    with a value head, its values; both `(batch, response_len)`, zero on padding."""
    device = next(model.parameters()).device
    seq_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.zeros(len(samples), seq_len, dtype=torch.long)  # right-padded
    attention_mask = torch.zeros(len(samples), seq_len, dtype=torch.long)
    # positions[i, t]: the sequence position whose output predicts response token t.
    positions = torch.zeros(len(samples), response_len, dtype=torch.long)
    targets = torch.zeros(len(samples), response_len, dtype=torch.long)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_ids + sample.response_ids
        n_prompt, n_response = len(sample.prompt_ids), len(sample.response_ids)
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
        positions[row, :n_response] = torch.arange(n_prompt - 1, n_prompt - 1 + n_response)
        targets[row, :n_response] = torch.tensor(sample.response_ids)
    positions, targets = positions.to(device), targets.to(device)

    # bf16 autocast is for accelerators and CPUs with bf16 units (AVX512-BF16/AMX): elsewhere
    # it is emulated and ~15x slower.
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        # The LM head runs on the response positions only: the prompt's logits, a
        # (prompt_len x vocab) tensor per sample, are never needed.
        hidden = model.base_model(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
        ).last_hidden_state
        hidden = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        lengths = torch.tensor([len(s.response_ids) for s in samples], device=device)
        mask = torch.arange(response_len, device=device) < lengths[:, None]  # (batch, response_len)
        # Real response tokens only, flattened: padding never reaches the LM head.
        flat = _chunked_logprobs(model, hidden[mask], targets[mask], cfg)  # (n_tokens,)
    logprob = torch.zeros(mask.shape, device=device).masked_scatter(mask, flat)  # (batch, response_len)

    values = None if value_head is None else value_head(hidden.float()) * mask  # (batch, response_len)
    return logprob, values
