"""The log-prob of each row's target token and the entropy of its distribution, from logits
`(tokens, vocab)`, as one autograd function that keeps only the logits and their logsumexp for
the backward pass.

Written with autograd's own ops, the same two numbers keep four more `(tokens, vocab)` tensors
(the shifted logits, the softmax, and the masked products of the entropy): for SmolLM2's 49k
vocabulary that is 0.8 MB a token. Here the backward pass recomputes the softmax from the
logits and the logsumexp, and writes the gradient over it in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def logprob_and_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """`(log_softmax(logits)[target], entropy(softmax(logits)))`, each `(tokens,)`, for logits
    `(tokens, vocab)` and targets `(tokens,)`. Logits of -inf (masked tokens) add nothing to
    the entropy and get no gradient."""
    return _LogprobEntropy.apply(logits, targets)


def target_logprob(logits: Tensor, targets: Tensor) -> Tensor:
    """`log_softmax(logits)[target]` `(tokens,)`, as the target's logit less the logsumexp:
    without a second vocab-sized tensor."""
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        # The log-prob as the LM head takes it without the entropy (`target_logprob`), to the
        # bit: scored with or without the entropy, a policy's log-probs are the same numbers (a
        # KL term between them is exactly 0, not rounding that AdamW would turn into a step).
        logprob = target_logprob(logits, targets)
        # The entropy's log-probs as (z - max) - logsumexp(z - max): both terms small, so that
        # they do not cancel catastrophically in fp32 for large logits (3e4 + log 3 - 3e4).
        top = logits.amax(dim=-1)
        log_probs = logits - top[:, None]
        lse = log_probs.logsumexp(dim=-1)
        log_probs -= lse[:, None]
        # -sum(p log p), p taking the place of a second vocab-sized tensor; a token of
        # probability 0 (a logit of -inf) adds 0, not 0 * -inf.
        entropy = -log_probs.exp().mul_(log_probs.nan_to_num_(neginf=0.0)).sum(dim=-1)
        ctx.save_for_backward(logits, targets, top, lse, entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprob: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor, None]:
        logits, targets, top, lse, entropy = ctx.saved_tensors
        grad_logprob = torch.zeros_like(entropy) if grad_logprob is None else grad_logprob
        log_probs = (logits - top[:, None]).sub_(lse[:, None])
        probs = log_probs.exp()
        # d logprob / d z = onehot(target) - p; d entropy / d z = -p * (log p + entropy).
        grad = log_probs.nan_to_num_(neginf=0.0)
        if grad_entropy is None:
            grad.zero_()
        else:
            grad.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        grad.add_(grad_logprob[:, None]).mul_(probs).neg_()
        grad.scatter_add_(-1, targets[:, None], grad_logprob[:, None])
        return grad, None
