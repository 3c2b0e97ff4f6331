"""Training forms of a decoder's RMSNorm and gated MLP that keep fewer activations for the
backward pass, with the same values and gradients.

Under autograd the stock modules keep every intermediate: an RMSNorm its fp32 input and the
normalised input, a SwiGLU MLP its gate projection, the gate's SiLU, the up projection and
their product (4 x intermediate size floats a token). The functions here keep the normalised
input and its inverse RMS, and the MLP's input, gate and up projections, and recompute the rest
(a few elementwise products) in the backward pass: about 6,000 fewer floats a token and layer
on SmolLM2-135M, and fewer tensors to allocate and free.

`lean_activations(model)` puts them in place of the forward of the Llama-family modules that
have them (Llama, Mistral, Qwen 2 and 3: the same RMSNorm and MLP), for the block. Each call
still takes the stock forward unless autograd records it and the lean form computes exactly
what the module would: no autocast, plain bias-free linear layers with no hooks (a LoRA adapter
or DeepSpeed ZeRO-3's parameter gathering keeps the stock path), SiLU gating.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
LEAN_NORMS = frozenset(f"{family}RMSNorm" for family in FAMILIES)
LEAN_MLPS = frozenset(f"{family}MLP" for family in FAMILIES)
SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's, and transformers' ACT2FN["silu"]


@contextmanager
def lean_activations(model: nn.Module) -> Iterator[None]:
    """Within the block, the RMSNorm and MLP modules of `model` that have a lean form take it
    whenever it applies (module docstring); their own forward again afterwards."""
    patched = []
    for module in model.modules():
        name = type(module).__name__
        lean = _norm_forward if name in LEAN_NORMS else _mlp_forward if name in LEAN_MLPS else None
        if lean is not None and "forward" not in vars(module):
            module.forward = MethodType(lean, module)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _recorded(x: Tensor) -> bool:
    """Whether autograd records an op on `x`, in full precision (no autocast)."""
    return torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


def _plain(linear: nn.Module) -> bool:
    """A bias-free nn.Linear whose forward nothing wraps: its product is `x @ weight.T`."""
    return (
        type(linear) is nn.Linear
        and linear.bias is None
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        and not nn.modules.module._global_forward_hooks
        and not nn.modules.module._global_forward_pre_hooks
    )


def _norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    if not _recorded(hidden_states):
        return type(self).forward(self, hidden_states)
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    if not (
        _recorded(x)
        and type(self.act_fn).__name__ in SILU
        and all(map(_plain, (self.gate_proj, self.up_proj, self.down_proj)))
    ):
        return type(self).forward(self, x)
    return SwiGLUFunction.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class RMSNormFunction(torch.autograd.Function):
    """`weight * (x / rms(x))` as the Llama RMSNorm computes it (fp32 statistics, the normalised
    input cast back to x's dtype); keeps the fp32 normalised input and the inverse RMS."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        normed = x.float() * inv_rms
        ctx.save_for_backward(normed, inv_rms, weight)
        ctx.input_dtype = x.dtype
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        normed, inv_rms, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(ctx.input_dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).float()
            # d/dx of x * r(x): r * (g - n * mean(g * n)), n the normalised input.
            grad_x = inv_rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
            grad_x = grad_x.to(ctx.input_dtype)
        return grad_x, grad_weight, None


class SwiGLUFunction(torch.autograd.Function):
    """`down(silu(gate(x)) * up(x))` with bias-free weights; keeps x and the gate and up
    projections, and recomputes the SiLU and the product in the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gate, up = flat @ w_gate.T, flat @ w_up.T
        ctx.save_for_backward(flat, gate, up, w_gate, w_up, w_down)
        ctx.input_shape = x.shape
        return ((F.silu(gate) * up) @ w_down.T).reshape(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        flat, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        sig = torch.sigmoid(gate)
        silu = gate * sig
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        grad_down = grad.T @ (silu * up) if need_down else None
        grad_act = grad @ w_down  # d/d(silu(gate) * up)
        grad_up = grad_act * silu
        # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))
        grad_x = None
        if need_x:
            grad_x = (grad_gate @ w_gate + grad_up @ w_up).reshape(ctx.input_shape)
        return (
            grad_x,
            grad_gate.T @ flat if need_gate else None,
            grad_up.T @ flat if need_up else None,
            grad_down,
        )
