"""The lean training forms of RMSNorm and the gated MLP compute what the stock modules do, in
value and gradient, while keeping fewer activations; they step aside where they would not."""

from __future__ import annotations

import copy

import torch
from torch import nn

from trainer_core.models.lean_activations import lean_activations
from trainer_core.models.loading import Policy


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = (logits.log_softmax(-1)[..., 0] * torch.linspace(-1, 1, ids.shape[1], dtype=logits.dtype)).sum()
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _backward_nodes(output: torch.Tensor) -> set[str]:
    seen, names, todo = set(), set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [next_node for next_node, _ in node.next_functions]
    return names


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of a forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(storages.values())


def test_same_values_and_gradients_as_the_stock_modules(tiny_policy: Policy) -> None:
    stock = tiny_policy.model.train()
    lean = copy.deepcopy(stock)
    ids = torch.randint(0, stock.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, grads = _loss_and_grads(stock, ids)
    with lean_activations(lean):
        lean_logits, lean_grads = _loss_and_grads(lean, ids)
        nodes = _backward_nodes(lean(input_ids=ids).logits)
    assert {"RMSNormFunctionBackward", "SwiGLUFunctionBackward"} <= nodes
    # The same products; the norms' gradients sum in another order (fp32 rounding).
    torch.testing.assert_close(lean_logits, logits, rtol=0, atol=0)
    for got, want in zip(lean_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_keeps_fewer_activations(tiny_policy: Policy) -> None:
    """Per token and layer the stock modules keep, beyond what both keep, the normalised input
    of each of the two norms and the MLP's SiLU and product (2 x hidden + 2 x intermediate
    floats); the lean forms keep none of those."""
    model = tiny_policy.model.train()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    stock = _saved_bytes(model, ids)
    with lean_activations(model):
        lean = _saved_bytes(model, ids)
    fewer = ids.numel() * cfg.num_hidden_layers * (2 * cfg.hidden_size + 2 * cfg.intermediate_size) * 4
    assert stock - lean >= fewer, (stock, lean, fewer)


def test_stock_forward_without_autograd_and_after_the_block(tiny_policy: Policy) -> None:
    model = tiny_policy.model
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with lean_activations(model), torch.no_grad():
        nodes = model(input_ids=ids).logits.grad_fn
    assert nodes is None
    assert not any("forward" in vars(module) for module in model.modules())
    assert not {"RMSNormFunctionBackward", "SwiGLUFunctionBackward"} & _backward_nodes(model(input_ids=ids).logits)


def test_a_hooked_or_wrapped_projection_keeps_the_stock_mlp(tiny_policy: Policy) -> None:
    """A forward hook on a projection (as DeepSpeed ZeRO-3 gathers parameters) must run, so that
    MLP takes its own forward; the other layers' MLPs stay lean."""
    model = tiny_policy.model.train()
    calls = []
    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda module, args: calls.append(module))
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with lean_activations(model):
        logits = model(input_ids=ids).logits
    assert len(calls) == 1
    assert "SwiGLUFunctionBackward" in _backward_nodes(logits)
    assert model.config.num_hidden_layers > 1
