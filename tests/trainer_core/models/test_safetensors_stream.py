"""Safetensors files read front to back into a live model: straight into its memory when the
dtype matches, through a staging buffer a chunk at a time when it does not; truncated files and
files missing weights are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer_core.models import safetensors_stream
from trainer_core.models.loading import load_policy, load_weights, save_policy
from trainer_core.models.safetensors_stream import SINGLE_FILE


@pytest.fixture
def saved(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    policy = load_policy("tiny", cache_dir=tmp_path / "models")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p))
    save_policy(policy, tmp_path / "v1", shard_bytes=64 * 1024)
    return policy.model.state_dict(), tmp_path / "v1"


def test_weights_of_another_dtype_are_converted_a_chunk_at_a_time(
    saved: tuple[dict[str, torch.Tensor], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights, model_dir = saved
    monkeypatch.setattr(safetensors_stream, "CHUNK_BYTES", 1000)  # many chunks per tensor, cut mid-row
    served = load_policy("tiny", cache_dir=tmp_path / "models").model.to(torch.bfloat16)
    load_weights(served, model_dir)
    for name, value in weights.items():
        assert torch.equal(served.state_dict()[name], value.to(torch.bfloat16)), name


def test_a_truncated_shard_is_refused(saved: tuple[dict[str, torch.Tensor], Path], tmp_path: Path) -> None:
    _, model_dir = saved
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match="ended early"):
        load_weights(load_policy("tiny", cache_dir=tmp_path / "models").model, model_dir)


def test_files_that_leave_out_a_weight_are_refused(saved: tuple[dict[str, torch.Tensor], Path], tmp_path: Path) -> None:
    weights, _ = saved
    (tmp_path / "partial").mkdir()
    save_file({n: t for n, t in weights.items() if "lm_head" not in n}, tmp_path / "partial" / SINGLE_FILE)
    with pytest.raises(ValueError, match=r"hold no value for 1 .*lm_head.weight"):
        load_weights(load_policy("tiny", cache_dir=tmp_path / "models").model, tmp_path / "partial")
