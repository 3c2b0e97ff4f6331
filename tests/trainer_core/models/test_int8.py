"""Weight-only int8 Linear layers: the rounding bound, the output, the memory."""

from __future__ import annotations

import torch
from torch import nn

from trainer_core.models.int8 import Int8Linear, quantize_linears_int8


def test_each_weight_is_within_half_a_step_of_its_group() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    linear.weight.data[:, 5] *= 50  # an outlier column: only its own groups get a coarser step

    q = Int8Linear(linear, group_size=64)

    step = linear.weight.detach().reshape(96, 4, 64).abs().amax(-1, keepdim=True) / 127
    error = (q.dequantized_weight() - linear.weight.detach()).reshape(96, 4, 64).abs()
    assert (error <= step / 2 + 1e-7).all()
    assert error[:, 1:].max() < error[:, :1].max() / 10  # groups away from the outlier stay fine
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() == 127


def test_the_output_is_the_dequantized_weights_product() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 32)
    x = torch.randn(3, 7, 128)

    q = Int8Linear(linear)

    torch.testing.assert_close(q(x), x @ q.dequantized_weight().T + linear.bias, rtol=1e-5, atol=1e-5)
    assert (q(x) - linear(x)).abs().max() < 0.01 * linear(x).abs().max()
    assert Int8Linear(nn.Linear(100, 8, bias=False)).group_size == 100  # 100 columns: one group per row


def test_quantize_linears_int8_replaces_every_linear_and_quarters_their_bytes() -> None:
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 256), nn.ReLU(), nn.Sequential(nn.Linear(256, 64)))
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = model(x)
    fp32_bytes = sum(p.numel() * 4 for m in model.modules() if type(m) is nn.Linear for p in (m.weight,))

    assert quantize_linears_int8(model) == 2

    assert not any(type(m) is nn.Linear for m in model.modules())
    int8_bytes = sum(
        b.numel() * b.element_size() for m in model.modules() if isinstance(m, Int8Linear) for b in m.buffers()
    )
    assert int8_bytes == fp32_bytes / 4 * (1 + 4 / 64)  # 1 byte a weight, a 4-byte scale per 64
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0.02, atol=0.02)
