"""A reward model loaded with quantize="8bit" on the CPU scores as the full model does, within
the int8 weights' rounding; 4bit is refused there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.trainer_core.supervised.test_reward_model import HELD_OUT_WORDS, TRAIN_WORDS, yes_no_pairs
from trainer_core.models.int8 import Int8Linear
from trainer_core.models.loading import Policy
from trainer_core.supervised.reward_model import (
    RewardModel,
    RewardModelConfig,
    evaluate_reward_model,
    train_reward_model,
)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-backbone reward model of test_reward_model_learns_a_synthetic_preference, saved."""
    from trainer_core.models.loading import load_policy

    tmp = tmp_path_factory.mktemp("rm-quantized")
    policy: Policy = load_policy("tiny", cache_dir=tmp_path_factory.getbasetemp() / "models")
    rm = RewardModel.from_policy(policy, max_len=64)
    cfg = RewardModelConfig(learning_rate=3e-4, epochs=3, batch_size=8, micro_batch_size=4)
    train_reward_model(rm, yes_no_pairs(TRAIN_WORDS, 64, seed=0), cfg)
    rm.save(tmp / "rm")
    return tmp / "rm"


def test_int8_scores_stay_close_to_the_full_ones(rm_dir: Path) -> None:
    full = RewardModel.load(rm_dir)
    int8 = RewardModel.load(rm_dir, quantize="8bit")
    held_out = yes_no_pairs(HELD_OUT_WORDS, 32, seed=1)
    prompts = [p.prompt for p in held_out] * 2
    responses = [p.chosen for p in held_out] + [p.rejected for p in held_out]

    want, got = torch.tensor(full.score(prompts, responses)), torch.tensor(int8.score(prompts, responses))

    assert torch.corrcoef(torch.stack([want, got]))[0, 1] > 0.999  # measured 0.999994
    # Rounding puts each weight within half a step, max|w| / 254 of its group (<= 0.4%); through
    # the two layers that moves a score by a fraction of a percent of the scores' range: tolerance
    # 2% of it for the largest error, 0.5% for the mean (measured 0.53% and 0.12%, range ~11).
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max() < 0.02 * spread
    assert (got - want).abs().mean() < 0.005 * spread
    assert not torch.equal(got, want)  # the weights really are int8: the scores moved a little
    # Pairs the full model separates clearly (margin over 10% of the range) keep their order.
    half = len(held_out)
    margin_full, margin_int8 = want[:half] - want[half:], got[:half] - got[half:]
    clear = margin_full.abs() > 0.1 * spread
    assert clear.sum() >= half // 2
    assert torch.equal(margin_int8[clear] > 0, margin_full[clear] > 0)
    assert (
        evaluate_reward_model(int8, held_out)["rm/accuracy"]
        == evaluate_reward_model(full, held_out)["rm/accuracy"]
        == 1.0
    )
    # Only the weights are quantized: a score does not depend on the batch it is scored in.
    alone = torch.tensor([int8.score([p], [r])[0] for p, r in zip(prompts[:8], responses[:8], strict=True)])
    torch.testing.assert_close(alone, got[:8], rtol=0, atol=1e-4)


def test_int8_quantizes_the_backbone_linears_and_keeps_the_head_fp32(rm_dir: Path) -> None:
    int8 = RewardModel.load(rm_dir, quantize="8bit")
    full = RewardModel.load(rm_dir)

    quantized = [m for m in int8.backbone.modules() if isinstance(m, Int8Linear)]
    assert (
        len(quantized) == sum(isinstance(m, nn.Linear) for m in full.backbone.modules()) == 2 * 7
    )  # q k v o gate up down
    assert not any(type(m) is nn.Linear for m in int8.backbone.modules())
    assert quantized[0].qweight.dtype == torch.int8
    assert type(int8.head) is nn.Linear and int8.head.weight.dtype == torch.float32
    torch.testing.assert_close(int8.head.state_dict(), full.head.state_dict(), rtol=0, atol=0)
    assert int8.backbone.embed_tokens.weight.dtype == torch.float32
    assert not int8.training


def test_4bit_on_the_cpu_is_refused_with_the_alternative(rm_dir: Path) -> None:
    with pytest.raises(ValueError, match="4bit quantization needs a CUDA GPU.*use 8bit"):
        RewardModel.load(rm_dir, quantize="4bit")
    with pytest.raises(ValueError, match="quantize is one of 4bit, 8bit"):
        RewardModel.load(rm_dir, quantize="2bit")  # type: ignore[arg-type]
