"""LoRA adapters (peft) on a policy, and the reference policy they give for free.

With LoRA the frozen base weights *are* the reference policy: disabling the adapter turns the
policy back into it, so KL-to-reference costs no second copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel

from trainer_core.memory import frozen_parameter_audit

# What peft's save_pretrained writes beside the adapter's weights: its presence marks an adapter.
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA adapter on every linear layer but the LM head (peft's "all-linear")."""

    rank: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # 0 keeps the importance ratio exact: dropout would make pi noisy

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA needs rank >= 1, alpha > 0 and 0 <= dropout < 1, got {self}")


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a peft `PeftModel` whose only trainable parameters are the adapter's.

    The base weights stay where they are (no copy); they are frozen by peft.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def check_only_adapter_trains(model: nn.Module) -> None:
    """Raise unless a LoRA `model`'s adapter weights are all that requires grad
    (`memory.frozen_parameter_audit`): a base weight left trainable would silently be trained,
    with full optimizer state for it."""
    adapter = [name for name, _ in model.named_parameters() if "lora_" in name]
    unfrozen = frozen_parameter_audit(model, adapter)
    if unfrozen:
        raise ValueError(
            f"{len(unfrozen)} parameters outside the LoRA adapter require grad, e.g. {unfrozen[:3]}: "
            "freeze them (requires_grad_(False)) or train without lora_rank"
        )


def is_adapter_dir(path: Path) -> bool:
    """True for a directory holding a saved adapter (what `save_pretrained` of a LoRA policy
    writes) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_adapter(model: nn.Module, adapter_dir: Path, *, trainable: bool) -> nn.Module:
    """`model` with the adapter saved in `adapter_dir`, unmerged: a base model is wrapped (its
    weights stay where they are; the adapter trainable or frozen), a peft model has its adapter's
    weights replaced in place. Either way no weights of the base are copied."""
    from peft import PeftModel, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    if not is_lora(model):
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    device = next(model.parameters()).device
    weights = load_peft_weights(str(adapter_dir), device=str(device))
    result = set_peft_model_state_dict(model, weights, adapter_name=model.active_adapter)
    if result.unexpected_keys:
        raise ValueError(
            f"the adapter in {adapter_dir} does not fit the model: unexpected {result.unexpected_keys[:5]}"
        )
    return model


def is_lora(model: nn.Module) -> bool:
    """True for a peft model (a policy with an adapter)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside `model` (itself, or a peft model's base with the adapter
    layers injected)."""
    return model.get_base_model() if is_lora(model) else model


@contextmanager
def reference_policy(model: nn.Module, ref_model: nn.Module | None) -> Iterator[nn.Module]:
    """The reference policy for KL: `ref_model` when given, else a LoRA policy with its adapter
    disabled for the duration of the block."""
    if ref_model is not None:
        yield ref_model
    elif is_lora(model):
        with model.disable_adapter():
            yield model
    else:
        raise ValueError("a KL term needs a reference: pass ref_model, or train a LoRA adapter")
