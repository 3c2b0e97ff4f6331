"""A policy switched from generation to training and back: train mode, per-layer activation
checkpointing, the lean forms of its norms and MLPs, and the memory measures of an update's
backward pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from trainer_core.memory import decoder_layers, release_during_backward
from trainer_core.models.lean_activations import lean_activations
from trainer_core.models.lora import causal_lm


@contextmanager
def training_mode(model: nn.Module, gradient_checkpointing: bool) -> Iterator[None]:
    """Train mode (and gradient checkpointing, and `lean_activations`) for the update;
    afterwards the model is back in eval mode without checkpointing, ready to generate with its
    KV cache."""
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
        with ExitStack() as measures:
            measures.enter_context(lean_activations(lm))
            if on_host:
                measures.enter_context(release_during_backward(decoder_layers(lm)))
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
