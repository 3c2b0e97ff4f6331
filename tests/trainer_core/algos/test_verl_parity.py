"""Differential tests: `trainer_core.algos` against verl 0.9.1's own `core_algos` code
(tests/verl_reference.py), on the same seeded random inputs (several shapes, masks with holes
and an empty row, float32 and float64): every registered policy loss (value, gradient and the
metrics verl returns), every loss aggregation mode, every KL estimator (value and gradient) and
every advantage estimator verl has.

Where spotrl deliberately differs from verl, the test names the difference and asserts
spotrl's documented behaviour next to verl's:
  - GSPO: spotrl always aggregates seq-mean-token-mean (the paper's sequence-level objective);
    verl 0.9.1 honours `loss_agg_mode`.
  - GMPO: spotrl's mean over sequences leaves out sequences without a real token; verl's
    `torch.mean` counts them as 0.
  - Dual clip: spotrl's is optional (`clip_c` None); verl's vanilla loss always applies one
    (`clip_ratio_c`, default 3), so None is compared with verl at clip_ratio_c = inf.
  - k3 clamp: verl always clamps k3 to [-10, 10]; spotrl only with `kl_clamp` > 0.
  - A group of one: spotrl's GRPO, RLOO and REINFORCE++-baseline give it advantage 0 (it is
    its own baseline); verl uses mean 0 (and std 1), so its advantage is its raw reward.
  - GAE: spotrl zeroes advantages and returns on padding; verl leaves values there.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from contracts.training import KLEstimator, LossAggMode, PolicyLoss
from tests.verl_reference import core_algos
from trainer_core.algos import (
    POLICY_LOSSES,
    PolicyLossParams,
    aggregate_loss,
    aggregation_weight,
    compute_advantages,
    compute_policy_loss,
    kl_penalty,
)

SHAPES = [(3, 5), (8, 17), (16, 40)]
DTYPES = [torch.float32, torch.float64]
CASES = [(shape, dtype) for shape in SHAPES for dtype in DTYPES]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # float64's rtol 1e-7 allows for verl's epsilons (a sequence's length + 1e-8 in
    # seq-mean-token-mean and GMPO, a mask's sum + 1e-8 in masked_mean): relative 1e-8 / length.
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-7, "atol": 1e-10}


@pytest.fixture(scope="module")
def verl():
    return core_algos()


def test_importing_verl_leaves_neither_verl_nor_its_stubs_importable(verl) -> None:
    assert verl.__name__ == "verl.trainer.ppo.core_algos"
    for name in ("verl", "ray", "omegaconf", "tensordict"):
        assert name not in sys.modules
        assert importlib.util.find_spec(name) is None, name


def _mask(gen: torch.Generator, shape: tuple[int, int], dtype: torch.dtype, empty_row: bool = True) -> torch.Tensor:
    """Right padding of random lengths, holes inside the responses (tool observations), and,
    when `empty_row`, one row without a real token."""
    batch, length = shape
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)
    holes = torch.rand(shape, generator=gen) < 0.2
    holes[:, 0] = False  # every row keeps its first token, so only the chosen row is empty
    mask = mask.masked_fill(holes, 0.0)
    if empty_row:
        mask[-1] = 0.0
    return mask


def _policy_inputs(seed: int, shape: tuple[int, int], dtype: torch.dtype, empty_row: bool = True):
    gen = torch.Generator().manual_seed(seed)
    logprob = -2.0 * torch.rand(shape, generator=gen, dtype=dtype)
    old = logprob + 0.3 * torch.randn(shape, generator=gen, dtype=dtype)  # ratios well outside 1 +- 0.2
    advantages = torch.randn(shape, generator=gen, dtype=dtype)
    is_weights = 0.5 + torch.rand(shape, generator=gen, dtype=dtype)
    return logprob, old, advantages, _mask(gen, shape, dtype, empty_row), is_weights


def _actor_config(verl, p: PolicyLossParams):
    """verl's own ActorConfig (GSPO and CISPO assert its type), with spotrl's parameters."""
    return verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=p.clip_low,
        clip_ratio_low=p.clip_low,
        clip_ratio_high=p.clip_high,
        clip_ratio_c=math.inf if p.clip_c is None else p.clip_c,
        policy_loss=SimpleNamespace(
            clip_cov_ratio=p.clip_cov_ratio,
            clip_cov_lb=p.clip_cov_lb,
            clip_cov_ub=p.clip_cov_ub,
            kl_cov_ratio=p.kl_cov_ratio,
            ppo_kl_coef=p.ppo_kl_coef,
        ),
    )


# Clip-/KL-Cov at their default ratio 0.0002 would touch one token of these small batches.
PARAMS = PolicyLossParams(clip_low=0.2, clip_high=0.28, clip_c=3.0, clip_cov_ratio=0.2, kl_cov_ratio=0.2)
VERL_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def _ours_and_verls(verl, name, agg, p, inputs, use_is, verl_agg=None):
    """(loss, d loss / d logprob, metrics) of spotrl's and of verl's `name`, on one input."""
    logprob, old, advantages, mask, is_weights = inputs
    w = is_weights if use_is else None
    results = []
    for compute in (
        lambda lp: compute_policy_loss(name, lp, old, advantages, mask, p, agg, w),
        lambda lp: getattr(verl, f"compute_policy_loss_{name}")(
            old, lp, advantages, mask, verl_agg or agg, _actor_config(verl, p), w
        ),
    ):
        lp = logprob.clone().requires_grad_()
        torch.manual_seed(7)  # clip_cov draws the tokens it cuts from torch's global generator
        loss, metrics = compute(lp)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    return results


@pytest.mark.parametrize("agg", list(LossAggMode))
@pytest.mark.parametrize("name", list(PolicyLoss))
def test_policy_loss_matches_verl(verl, name: PolicyLoss, agg: LossAggMode) -> None:
    cut = 0.0
    for seed, (shape, dtype) in enumerate(CASES):
        for use_is in (False, True):
            # GMPO: verl's mean over sequences counts an empty row; compared without one here.
            inputs = _policy_inputs(seed, shape, dtype, empty_row=name != PolicyLoss.GEO_MEAN)
            # GSPO: spotrl is always seq-mean-token-mean (the paper's); verl follows loss_agg_mode.
            verl_agg = LossAggMode.SEQ_MEAN_TOKEN_MEAN if name == PolicyLoss.GSPO else agg
            (loss, grad, metrics), (v_loss, v_grad, v_metrics) = _ours_and_verls(
                verl, name, agg, PARAMS, inputs, use_is, verl_agg
            )
            torch.testing.assert_close(loss, v_loss, **_tol(dtype))
            torch.testing.assert_close(grad, v_grad, **_tol(dtype))
            for key in VERL_METRICS:
                if f"actor/{key}" in v_metrics:
                    assert metrics[key].item() == pytest.approx(v_metrics[f"actor/{key}"], rel=1e-5, abs=1e-7), key
            cut += metrics["pg_clipfrac"].item() if name == PolicyLoss.CLIP_COV else 0.0
    if name == PolicyLoss.CLIP_COV:
        assert cut > 0, "no token was cut: the Clip-Cov comparison did not exercise the cut"


def test_ppo_without_dual_clip_is_verls_with_an_infinite_bound(verl) -> None:
    params = PolicyLossParams(clip_low=0.2, clip_high=0.2, clip_c=None)
    for seed, (shape, dtype) in enumerate(CASES):
        inputs = _policy_inputs(seed, shape, dtype)
        (loss, grad, metrics), (v_loss, v_grad, v_metrics) = _ours_and_verls(
            verl, PolicyLoss.VANILLA, LossAggMode.TOKEN_MEAN, params, inputs, use_is=False
        )
        torch.testing.assert_close(loss, v_loss, **_tol(dtype))
        torch.testing.assert_close(grad, v_grad, **_tol(dtype))
        assert metrics["pg_clipfrac_lower"].item() == v_metrics["actor/pg_clipfrac_lower"] == 0.0


def test_gmpo_leaves_out_empty_sequences_which_verl_counts_as_zero(verl) -> None:
    inputs = _policy_inputs(0, (8, 17), torch.float64, empty_row=True)
    (loss, _, _), (v_loss, _, _) = _ours_and_verls(verl, PolicyLoss.GEO_MEAN, "token-mean", PARAMS, inputs, False)
    mask = inputs[3]
    n_real = (mask.sum(dim=-1) > 0).sum()
    torch.testing.assert_close(loss * n_real / mask.shape[0], v_loss)


def test_gspo_verl_honours_the_aggregation_mode_spotrl_keeps_the_papers(verl) -> None:
    inputs = _policy_inputs(1, (8, 17), torch.float64)
    (loss, _, _), (v_loss, _, _) = _ours_and_verls(verl, PolicyLoss.GSPO, "token-sum", PARAMS, inputs, False)
    (seq_mean, _, _), _ = _ours_and_verls(verl, PolicyLoss.GSPO, "seq-mean-token-mean", PARAMS, inputs, False)
    torch.testing.assert_close(loss, seq_mean)
    assert not torch.isclose(loss, v_loss)


def test_every_registered_policy_loss_is_one_verl_has(verl) -> None:
    assert all(callable(getattr(verl, f"compute_policy_loss_{name}")) for name in POLICY_LOSSES)


# --- aggregation -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(LossAggMode))
def test_aggregate_loss_matches_verl_agg_loss(verl, mode: LossAggMode) -> None:
    for seed, (shape, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        loss_mat = torch.randn(shape, generator=gen, dtype=dtype)
        mask = _mask(gen, shape, dtype)
        ours, theirs = aggregate_loss(loss_mat, mask, mode), verl.agg_loss(loss_mat, mask, mode)
        torch.testing.assert_close(ours, theirs, **_tol(dtype))


@pytest.mark.parametrize("mode", list(LossAggMode))
def test_micro_batch_weights_give_verls_global_batch_loss(verl, mode: LossAggMode) -> None:
    """spotrl weighs each micro-batch's loss by `aggregation_weight` / the mini-batch's; verl
    divides each micro-batch's sums by the mini-batch's token or sequence count
    (`global_batch_info`). Summed over the micro-batches both must give the same loss."""
    gen = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(12, 9, generator=gen, dtype=torch.float64)
    mask = _mask(gen, (12, 9), torch.float64)
    micro = [slice(0, 5), slice(5, 8), slice(8, 12)]
    total = aggregation_weight(mask, mode)
    ours = sum(aggregate_loss(loss_mat[s], mask[s], mode) * aggregation_weight(mask[s], mode) / total for s in micro)
    info = {"batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(dim=-1) > 0).sum()}
    torch.testing.assert_close(ours, sum(verl.agg_loss(loss_mat[s], mask[s], mode, **info) for s in micro))
    torch.testing.assert_close(ours, aggregate_loss(loss_mat, mask, mode))


# --- KL --------------------------------------------------------------------------------------

VERL_KL_NAMES = {
    KLEstimator.K1: ("k1", "kl"),
    KLEstimator.K2: ("k2", "mse"),
    KLEstimator.K3: ("k3", "low_var_kl"),
    KLEstimator.ABS: ("abs",),
    KLEstimator.K1_PLUS: ("k1+",),
    KLEstimator.K3_PLUS: ("k3+",),
}


def _kl_value_and_grad(fn, logprob, ref, weights):
    lp = logprob.clone().requires_grad_()
    kl = fn(lp, ref)
    (kl * weights).sum().backward()
    return kl.detach(), lp.grad


@pytest.mark.parametrize("kind", list(KLEstimator))
def test_kl_penalty_matches_verl_value_and_gradient(verl, kind: KLEstimator) -> None:
    assert set(VERL_KL_NAMES) == set(KLEstimator)
    clamped_somewhere = False
    for seed, (shape, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        logprob = -3 * torch.rand(shape, generator=gen, dtype=dtype)
        ref = logprob + 4 * torch.randn(shape, generator=gen, dtype=dtype)  # some k3 above verl's clamp of 10
        weights = torch.randn(shape, generator=gen, dtype=dtype)
        for verl_name in VERL_KL_NAMES[kind]:
            v_kl, v_grad = _kl_value_and_grad(
                lambda lp, r, name=verl_name: verl.kl_penalty(lp, r, name), logprob, ref, weights
            )
            kl, grad = _kl_value_and_grad(lambda lp, r: kl_penalty(lp, r, kind, k3_clamp=10.0), logprob, ref, weights)
            torch.testing.assert_close(kl, v_kl, **_tol(dtype))
            torch.testing.assert_close(grad, v_grad, **_tol(dtype))
            # spotrl's default kl_clamp 0 leaves k3 unclamped: verl's value wherever verl did not clamp.
            unclamped, _ = _kl_value_and_grad(lambda lp, r: kl_penalty(lp, r, kind), logprob, ref, weights)
            below = v_kl.abs() < 10
            torch.testing.assert_close(unclamped[below], v_kl[below], **_tol(dtype))
            clamped_somewhere |= bool((~below).any())
    if kind in (KLEstimator.K3, KLEstimator.K3_PLUS):
        assert clamped_somewhere, "no k3 above 10: the clamp was not exercised"


# --- advantages ------------------------------------------------------------------------------


def _outcome_inputs(seed: int, length: int, dtype: torch.dtype, group_sizes: list[int]):
    """Token rewards on the real tokens, the mask, and group labels of the given sizes (shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    batch = sum(group_sizes)
    mask = _mask(gen, (batch, length), dtype, empty_row=False)
    token_rewards = torch.rand((batch, length), generator=gen, dtype=dtype) * mask
    labels = np.repeat(np.arange(len(group_sizes)), group_sizes)
    labels = labels[torch.randperm(batch, generator=gen).numpy()]
    return token_rewards, mask, labels


GROUPS = [[2, 3], [4, 4, 4, 4], [5, 2, 8, 3]]  # every group at least 2: see the singleton test
OUTCOME_CASES = [(sizes, shape[1], dtype) for sizes, (shape, dtype) in zip(GROUPS * 2, CASES, strict=True)]

# spotrl estimator -> (verl function, its extra keywords)
GROUP_ESTIMATORS = {
    "grpo": ("compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": True}),
    "dr_grpo": ("compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}),
    "rloo": ("compute_rloo_outcome_advantage", {}),
    "reinforce_pp_baseline": ("compute_reinforce_plus_plus_baseline_outcome_advantage", {}),
    "opo": ("compute_opo_outcome_advantage", {}),
    "grpo_passk": ("compute_grpo_passk_outcome_advantage", {"config": {"norm_adv_by_std_in_grpo": True}}),
}


@pytest.mark.parametrize("name", list(GROUP_ESTIMATORS))
def test_group_advantages_match_verl(verl, name: str) -> None:
    fn, kwargs = GROUP_ESTIMATORS[name]
    for seed, (sizes, length, dtype) in enumerate(OUTCOME_CASES):
        token_rewards, mask, labels = _outcome_inputs(seed, length, dtype, sizes)
        adv, ret = compute_advantages(name, token_rewards=token_rewards, response_mask=mask, group_ids=list(labels))
        v_adv, v_ret = getattr(verl, fn)(
            token_level_rewards=token_rewards.clone(), response_mask=mask, index=labels, **kwargs
        )
        torch.testing.assert_close(adv, v_adv, **_tol(dtype))
        torch.testing.assert_close(ret, v_ret, **_tol(dtype))
        assert adv.abs().sum() > 0


def test_a_group_of_one_is_its_own_baseline_in_spotrl_its_raw_reward_in_verl(verl) -> None:
    token_rewards, mask, labels = _outcome_inputs(0, 6, torch.float64, [1, 3, 1])
    single = torch.tensor([(labels == g).sum() == 1 for g in labels])
    scores = token_rewards.sum(dim=-1)
    for name in ("grpo", "rloo", "opo"):
        fn, kwargs = GROUP_ESTIMATORS[name]
        adv, _ = compute_advantages(name, token_rewards=token_rewards, response_mask=mask, group_ids=list(labels))
        v_adv, _ = getattr(verl, fn)(
            token_level_rewards=token_rewards.clone(), response_mask=mask, index=labels, **kwargs
        )
        torch.testing.assert_close(adv[~single], v_adv[~single])
        eps = 1e-6 if name == "grpo" else 0.0  # verl's singleton std is 1, plus its epsilon
        torch.testing.assert_close(v_adv[single], (scores[single] / (1 + eps))[:, None] * mask[single])
        # OPO's singleton baseline is 0 in both (its paper's optimal baseline needs other samples).
        expected = v_adv[single] if name == "opo" else torch.zeros_like(v_adv[single])
        torch.testing.assert_close(adv[single], expected)
    # REINFORCE++-baseline whitens over the batch what the groups leave: spotrl's singleton is
    # centred on itself, so its numbers are verl's on the batch where a singleton's reward is 0.
    rpp = GROUP_ESTIMATORS["reinforce_pp_baseline"][0]
    adv, _ = compute_advantages(
        "reinforce_pp_baseline", token_rewards=token_rewards, response_mask=mask, group_ids=list(labels)
    )
    v_adv, _ = getattr(verl, rpp)(token_level_rewards=token_rewards.clone(), response_mask=mask, index=labels)
    as_verl, _ = getattr(verl, rpp)(
        token_level_rewards=token_rewards.masked_fill(single[:, None], 0.0), response_mask=mask, index=labels
    )
    torch.testing.assert_close(adv, as_verl)
    assert not torch.allclose(adv, v_adv)


def test_reinforce_pp_matches_verl_across_mask_holes(verl) -> None:
    for seed, (shape, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        mask = _mask(gen, shape, dtype, empty_row=False)
        token_rewards = torch.randn(shape, generator=gen, dtype=dtype)  # on the holes too: both drop them
        adv, ret = compute_advantages("reinforce_pp", token_rewards=token_rewards, response_mask=mask, gamma=0.9)
        v_adv, v_ret = verl.compute_reinforce_plus_plus_outcome_advantage(
            token_level_rewards=token_rewards, response_mask=mask, config=SimpleNamespace(gamma=0.9)
        )
        torch.testing.assert_close(adv, v_adv, **_tol(dtype))
        torch.testing.assert_close(ret, v_ret, **_tol(dtype))


def test_remax_matches_verl(verl) -> None:
    for seed, (shape, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        mask = _mask(gen, shape, dtype, empty_row=False)
        token_rewards = torch.rand(shape, generator=gen, dtype=dtype) * mask
        baselines = torch.rand(shape[0], generator=gen, dtype=dtype)
        ours = compute_advantages("remax", token_rewards=token_rewards, response_mask=mask, reward_baselines=baselines)
        theirs = verl.compute_remax_outcome_advantage(
            token_level_rewards=token_rewards, reward_baselines=baselines, response_mask=mask
        )
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, **_tol(dtype))


def test_gae_matches_verl_on_the_real_tokens(verl) -> None:
    """verl leaves whitened advantages and values + advantages on padding; spotrl zeroes both."""
    for seed, (shape, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        mask = _mask(gen, shape, dtype, empty_row=False)
        token_rewards = torch.randn(shape, generator=gen, dtype=dtype) * mask
        values = torch.randn(shape, generator=gen, dtype=dtype)
        adv, ret = compute_advantages(
            "gae", token_rewards=token_rewards, response_mask=mask, values=values, gamma=0.95, lam=0.9
        )
        v_adv, v_ret = verl.compute_gae_advantage_return(token_rewards, values, mask, gamma=0.95, lam=0.9)
        torch.testing.assert_close(adv, v_adv * mask, **_tol(dtype))
        torch.testing.assert_close(ret, v_ret * mask, **_tol(dtype))
