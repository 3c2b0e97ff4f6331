from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer_core.engines import small_batch_linear
from trainer_core.engines.small_batch_linear import MAX_ROWS, decoding_linears, fits, kernel, linear


def test_the_kernel_builds_on_this_machine() -> None:
    """The set-up installs a C compiler with OpenMP (DeepSpeed's ops need one too) and these
    CPUs have AVX2: a None here means decoding silently runs at half speed."""
    assert kernel() is not None


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, MAX_ROWS])
@pytest.mark.parametrize(("inputs", "outputs"), [(576, 192), (13, 7), (8, 1), (64, 1536)])
def test_kernel_matches_f_linear(rows: int, inputs: int, outputs: int) -> None:
    """Odd output counts pair their last row with itself; inputs not a multiple of 8 take the
    scalar tail."""
    generator = torch.Generator().manual_seed(rows * inputs + outputs)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    assert fits(x, weight)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_kernel_takes_only_what_it_computes_right() -> None:
    x, weight = torch.randn(4, 16), torch.randn(8, 16)
    assert fits(x, weight)
    assert not fits(torch.randn(MAX_ROWS + 1, 16), weight)  # compute-bound: MKL's turn
    assert not fits(x.bfloat16(), weight.bfloat16())
    assert not fits(x, torch.randn(16, 8).T)  # a transposed view: rows are not contiguous
    assert not fits(x, nn.Parameter(weight))  # autograd wants a graph
    with torch.no_grad():
        assert fits(x, nn.Parameter(weight))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fits(x, weight)  # autocast asked for bf16 products


def test_decoding_linears_routes_small_batches_and_restores_the_modules() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 5, bias=False))
    decode, prefill = torch.randn(2, 1, 24), torch.randn(2, 30, 24)  # (batch, positions, in)
    with torch.no_grad():
        expected = model(decode), model(prefill)
        with decoding_linears(model):
            assert all("forward" in vars(m) for m in model if type(m) is nn.Linear)
            got = model(decode), model(prefill)
    assert all("forward" not in vars(m) for m in model)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], expected[1])  # 60 rows: F.linear itself


def test_decoding_linears_leaves_a_replaced_forward_alone() -> None:
    layer, hooked_layer = nn.Linear(8, 8), nn.Linear(8, 8)
    hooked = hooked_layer.forward
    hooked_layer.forward = hooked  # what accelerate's hooks do: an instance attribute
    model = nn.Sequential(layer, hooked_layer)
    with torch.no_grad(), decoding_linears(model):
        assert "forward" in vars(layer) and vars(hooked_layer)["forward"] is hooked
    assert vars(hooked_layer)["forward"] is hooked


def test_decoding_linears_changes_nothing_under_autograd_or_autocast() -> None:
    layer = nn.Linear(8, 8)
    with decoding_linears(layer):
        assert "forward" not in vars(layer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), decoding_linears(layer):
        assert "forward" not in vars(layer)


def test_the_kernel_is_cached_per_source(tmp_path, monkeypatch) -> None:
    """A fresh cache builds the library once; the next load finds it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = small_batch_linear._compiled()
    assert built.parent == tmp_path / "spotrl" and built.exists()
    mtime = built.stat().st_mtime_ns
    assert small_batch_linear._compiled() == built and built.stat().st_mtime_ns == mtime
