"""The forward pass of log-probs: LM-head chunks against one chunk, and the chunked entropy
against a plain computation from the full logits."""

from __future__ import annotations

import torch

from contracts.training import TrainConfig
from trainer_core.logprobs import chunked_lm_head, response_scores
from trainer_core.models.loading import Policy


def test_chunked_logprobs_match_one_chunk_in_value_and_gradient(tiny_policy, make_sample) -> None:
    samples = [make_sample([5, 6, 7], [8, 9, 10, 11][: 2 + k % 3], [-1.0] * (2 + k % 3), 1.0) for k in range(5)]
    results = []
    for chunk in (3, 1024):  # 3 splits the 15 tokens into 5 checkpointed chunks
        tiny_policy.model.zero_grad()
        logprob = response_scores(tiny_policy.model, samples, 4, TrainConfig(logprob_chunk_tokens=chunk)).logprob
        logprob.sum().backward()
        grads = [p.grad.clone() for p in tiny_policy.model.parameters() if p.grad is not None]
        results.append((logprob.detach(), grads))
    (lp_small, g_small), (lp_big, g_big) = results
    torch.testing.assert_close(lp_small, lp_big)
    assert (lp_small[0, 2:] == 0).all(), "padding positions stay zero"
    for a, b in zip(g_small, g_big, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_entropy_matches_the_full_logits_in_value_and_gradient(tiny_policy: Policy) -> None:
    """Entropy taken chunk by chunk inside the LM head (3 of 4 chunks checkpointed) against
    -sum p log p of one full `(tokens, vocab)` softmax, at temperature 0.7; gradients with
    respect to the hidden states and the LM head's weight."""
    model = tiny_policy.model
    head = model.get_output_embeddings()
    gen = torch.Generator().manual_seed(0)
    n_tokens, temperature = 10, 0.7
    hidden = torch.randn(n_tokens, model.config.hidden_size, generator=gen)
    targets = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=gen)
    weights = torch.rand(2, n_tokens, generator=gen)  # a loss that weighs every token differently

    def grads(logprob: torch.Tensor, entropy: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad((weights[0] * logprob + weights[1] * entropy).sum(), [h, head.weight]))

    h = hidden.clone().requires_grad_()
    logprob, entropy = chunked_lm_head(model, h, targets, chunk_tokens=3, temperature=temperature, with_entropy=True)
    chunked = (logprob, entropy, grads(logprob, entropy, h))

    h = hidden.clone().requires_grad_()
    log_p = torch.log_softmax(head(h).float() / temperature, dim=-1)  # (n_tokens, vocab), all at once
    logprob, entropy = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    plain = (logprob, entropy, grads(logprob, entropy, h))

    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], plain[1], atol=1e-5, rtol=1e-5)
    assert (chunked[1] > 0).all() and (chunked[1] < torch.log(torch.tensor(float(model.config.vocab_size)))).all()
    for got, want in zip(chunked[2], plain[2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert chunked_lm_head(model, hidden, targets, chunk_tokens=3)[1] is None, "no entropy unless asked"
