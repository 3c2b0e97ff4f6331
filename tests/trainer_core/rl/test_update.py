from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.engines.hf import HFEngine, SamplingParams
from trainer_core.logprobs import response_scores
from trainer_core.models.loading import Policy, encode_prompt
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch

GRPO_KEYS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_ref",
    "actor/grad_norm",
    "actor/loss",
    "reward/mean",
    "perf/tokens",
    "perf/seconds",
    "perf/tokens_per_s",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
}
PPO_KEYS = GRPO_KEYS | {"critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance"}


def _random_samples(make_sample: Callable[..., Sample], vocab: int, n: int = 8, seed: int = 0) -> list[Sample]:
    """Samples of varied prompt and response lengths whose behaviour log-probs are off the
    policy's (about -4.6 for the untrained tiny model), so some ratios get clipped."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        n_prompt, n_response = (int(x) for x in torch.randint(1, 12, (2,), generator=gen))
        samples.append(
            make_sample(
                prompt_ids=torch.randint(3, vocab, (n_prompt,), generator=gen).tolist(),
                response_ids=torch.randint(3, vocab, (n_response,), generator=gen).tolist(),
                logprobs=(-4.6 + 0.3 * torch.randn(n_response, generator=gen)).tolist(),
                reward=float(torch.rand((), generator=gen)),
                group_id=f"g{i % 2}",
            )
        )
    return samples


def _generated_samples(
    policy: Policy,
    make_sample: Callable[..., Sample],
    params: SamplingParams,
    seed: int,
    reward: Callable[[list[int]], float],
) -> list[Sample]:
    """8 samples of each of 2 prompts from the policy itself, one GRPO group per prompt."""
    n = 8
    engine = HFEngine(policy.model, policy.tokenizer)
    prompts = [encode_prompt(policy.tokenizer, t) for t in ("say a:", "aaa?") for _ in range(n)]
    completions = engine.generate(prompts, params, seed=seed)
    return [
        make_sample(
            prompt_ids=p,
            response_ids=c.token_ids,
            logprobs=c.logprobs,
            reward=reward(c.token_ids),
            group_id=f"g{i // n}",
        )
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_micro_batching_does_not_change_the_update(
    tiny_policy: Policy, make_sample: Callable[..., Sample], algorithm: str
) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    ref_model = copy.deepcopy(tiny_policy.model)
    with torch.no_grad():  # a reference that differs, so the KL term has a gradient
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    results = []
    # Fixed micro-batches of 2 and of 8 (the whole batch), and token-budget ones of <= 40 padded tokens.
    for micro, budget in ((2, 0), (8, 0), (8, 40)):
        model = copy.deepcopy(tiny_policy.model)
        value_head = ValueHead(model.config.hidden_size) if algorithm == "ppo" else None
        cfg = TrainConfig(
            algorithm=algorithm, micro_batch=micro, micro_batch_tokens=budget, kl_coef=0.1, max_grad_norm=1e9
        )
        # SGD, so parameters move linearly in the gradient (Adam's first step is ~lr * sign(g),
        # which magnifies float noise in near-zero gradients).
        trainable = list(model.parameters()) + (list(value_head.parameters()) if value_head else [])
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        metrics = train_on_batch(model, samples, cfg, optimizer, ref_model=ref_model, value_head=value_head)
        # Gradients are freed after the step: they would otherwise sit in memory through generation.
        assert all(p.grad is None for p in trainable)
        params = [p.detach().clone() for p in trainable]
        results.append((metrics, params))

    (m8, p8) = results[1]
    assert set(m8) == (PPO_KEYS if algorithm == "ppo" else GRPO_KEYS)
    assert 0 < m8["actor/pg_clipfrac"] < 1 and m8["actor/kl_ref"] > 0
    if algorithm == "ppo":
        # The value head starts at zero: all values 0, so the GAE return of token t of a response
        # is (gamma * lam)^(tokens after t) * reward, and no value is clipped.
        decay = cfg.gamma * cfg.lam
        returns = [
            decay ** (len(s.response_ids) - 1 - t) * s.reward for s in samples for t in range(len(s.response_ids))
        ]
        assert m8["critic/vf_loss"] == pytest.approx(0.5 * sum(r * r for r in returns) / len(returns), rel=1e-5)
        assert m8["critic/vf_clipfrac"] == 0.0
    for m, p in results[::2]:
        for key in m8:
            if not key.startswith("perf/"):
                assert m[key] == pytest.approx(m8[key], rel=1e-4, abs=1e-6), key
        # SGD at lr 0.1: equal updates mean equal gradients.
        for a, b in zip(p, p8, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fresh_samples_have_ratio_one(
    tiny_policy: Policy, make_sample: Callable[..., Sample], temperature: float
) -> None:
    """The trainer's log-probs of freshly sampled tokens equal the engine's behaviour log-probs."""
    params = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=12)
    samples = _generated_samples(tiny_policy, make_sample, params, seed=1, reward=len)
    cfg = TrainConfig(temperature=temperature, micro_batch=5)
    metrics = train_on_batch(tiny_policy.model, samples, cfg, build_optimizer(tiny_policy.model, cfg))
    assert abs(metrics["actor/ppo_kl"]) < 1e-5
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["perf/tokens"] == sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert not tiny_policy.model.training


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_critic_never_disturbs_the_actor(tiny_policy: Policy, make_sample: Callable[..., Sample], critic: str) -> None:
    """Shared: on the policy's detached hidden states. Separate: on its own backbone, which the
    value loss trains."""
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    actors = []
    for vf_coef in (0.0, 100.0):
        model = copy.deepcopy(tiny_policy.model)
        backbone = copy.deepcopy(tiny_policy.model) if critic == "separate" else None
        value_head = ValueHead(model.config.hidden_size, backbone=backbone)
        # Two steps: the head starts at zero, so only the second passes a gradient to the backbone.
        cfg = TrainConfig(algorithm="ppo", vf_coef=vf_coef, max_grad_norm=1e9, epochs=2)
        trainable = list(model.parameters()) + list(value_head.parameters())
        metrics = train_on_batch(model, samples, cfg, torch.optim.SGD(trainable, lr=0.1), value_head=value_head)
        actors.append([p.detach().clone() for p in model.parameters()])
        if backbone is not None and vf_coef > 0:
            assert metrics["critic/vf_loss"] > 0
            moved = [
                not torch.equal(a, b)
                for a, b in zip(backbone.parameters(), tiny_policy.model.parameters(), strict=True)
            ]
            assert any(moved), "the separate critic's backbone learns from the value loss"
    # SGD: identical actor updates mean identical actor gradients.
    for a, b in zip(*actors, strict=True):
        assert torch.equal(a, b)


def test_mini_batches_and_epochs_set_the_number_of_steps(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer), n=8)
    cfg = TrainConfig(mini_batch=3, micro_batch=2, epochs=2)  # 3 + 3 + 2 samples per epoch
    optimizer = build_optimizer(tiny_policy.model, cfg)
    train_on_batch(tiny_policy.model, samples, cfg, optimizer)
    assert {int(optimizer.state[p]["step"]) for p in tiny_policy.model.parameters()} == {6}


def test_kl_to_an_identical_reference_is_zero(tiny_policy: Policy, make_sample: Callable[..., Sample]) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    cfg = TrainConfig(kl_coef=0.5)
    ref = copy.deepcopy(tiny_policy.model)
    metrics = train_on_batch(tiny_policy.model, samples, cfg, build_optimizer(tiny_policy.model, cfg), ref_model=ref)
    assert metrics["actor/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["actor/loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-6)


def test_config_and_inputs_are_checked(tiny_policy: Policy, make_sample: Callable[..., Sample]) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer), n=2)
    model = tiny_policy.model
    with pytest.raises(ValueError):
        TrainConfig(algorithm="dpo")
    cfg = TrainConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_model"):
        train_on_batch(model, samples, cfg, build_optimizer(model, cfg))
    cfg = TrainConfig(algorithm="ppo")
    with pytest.raises(ValueError, match="value_head"):
        train_on_batch(model, samples, cfg, build_optimizer(model, cfg))


def _fraction_of_a(policy: Policy) -> Callable[[list[int]], float]:
    a = policy.tokenizer.convert_tokens_to_ids("a")
    return lambda ids: sum(t == a for t in ids) / len(ids)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_updates_raise_the_reward_on_a_toy_task(
    tiny_policy: Policy, make_sample: Callable[..., Sample], algorithm: str
) -> None:
    """Sample, score (fraction of response tokens that are "a"), update, repeat."""
    torch.manual_seed(0)
    value_head = ValueHead(tiny_policy.model.config.hidden_size) if algorithm == "ppo" else None
    cfg = TrainConfig(algorithm=algorithm, learning_rate=1e-2, micro_batch=16)
    optimizer = build_optimizer(tiny_policy.model, cfg, value_head)
    reward = _fraction_of_a(tiny_policy)
    rewards = []
    for iteration in range(16):
        samples = _generated_samples(tiny_policy, make_sample, SamplingParams(max_new_tokens=8), iteration, reward)
        metrics = train_on_batch(tiny_policy.model, samples, cfg, optimizer, value_head=value_head)
        rewards.append(metrics["reward/mean"])
    assert max(rewards[:3]) < 0.1
    assert sum(rewards[-3:]) / 3 > 0.6


def test_configured_advantage_estimator_is_used(tiny_policy, make_sample) -> None:
    probe = make_sample([5, 6], [7, 8], [0.0, 0.0], 0.0)
    with torch.no_grad():
        policy_logprob = response_scores(tiny_policy.model, [probe], 2, TrainConfig()).logprob[0]
    # Behaviour log-probs log(2) above the policy's: every token's ratio is 0.5.
    behaviour = (policy_logprob + torch.tensor(2.0).log()).tolist()
    samples = [make_sample([5, 6], [7, 8], behaviour, float(k % 2), group_id="g") for k in range(4)]
    metrics = {}
    for name in ("grpo", "rloo"):
        cfg = TrainConfig(algorithm="grpo", adv_estimator=name, learning_rate=0.0)
        metrics[name] = train_on_batch(tiny_policy.model, samples, cfg, build_optimizer(tiny_policy.model, cfg))
    # Same data, different advantages: grpo scales by the group std (±0.5 / sqrt(1/3) = ±0.87 for
    # [0,1,0,1]), rloo does not (1 - 1/3 = ±0.67). At ratio 0.5 a token of advantage +|A| costs
    # -0.5 |A| (unclipped) and one of -|A| costs +0.8 |A| (clipped at 1 - 0.2): pg_loss = 0.15 |A|.
    assert metrics["grpo"]["actor/pg_loss"] == pytest.approx(0.15 * 0.8660, abs=1e-4)
    assert metrics["rloo"]["actor/pg_loss"] == pytest.approx(0.15 * 0.6667, abs=1e-4)
    for m in metrics.values():
        assert m["actor/pg_clipfrac"] == pytest.approx(0.5)  # the negative-advantage half
        assert m["actor/ppo_kl"] == pytest.approx(0.6931, abs=1e-4)  # -log 0.5
    with pytest.raises(ValueError, match="gae"):
        TrainConfig(algorithm="grpo", adv_estimator="gae")


@pytest.mark.parametrize(
    ("share", "pack"), [(True, False), (False, True), (True, True)], ids=["shared-kv", "packed", "packed-shared"]
)
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_shared_prompts_and_packing_give_the_padded_full_pass_update(
    tiny_policy: Policy, make_sample: Callable[..., Sample], algorithm: str, share: bool, pack: bool
) -> None:
    """Each distinct prompt run once (its samples on its KV cache, or attending to it in a
    packed row), or every sample packed into one row without padding: the same log-probs,
    values and update as running every prompt + response padded, in full. Groups of 8 of 2
    prompts of different lengths, plus 8 samples of distinct random prompts."""
    assert tiny_policy.model.config._attn_implementation == "sdpa", "packing needs SDPA's custom masks"
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    samples = _generated_samples(tiny_policy, make_sample, params, seed=3, reward=len)
    samples += _random_samples(make_sample, len(tiny_policy.tokenizer))
    results = []
    for layout in (
        {"share_prompt_prefix": False, "pack_max_tokens": 0},
        {"share_prompt_prefix": share, "pack_max_tokens": 4096 if pack else 0},
    ):
        model = copy.deepcopy(tiny_policy.model)
        value_head = ValueHead(model.config.hidden_size) if algorithm == "ppo" else None
        cfg = TrainConfig(algorithm=algorithm, micro_batch=12, max_grad_norm=1e9, **layout)
        response_len = max(len(s.response_ids) for s in samples)
        with torch.no_grad():
            scored = response_scores(model, samples, response_len, cfg, value_head)
        trainable = list(model.parameters()) + (list(value_head.parameters()) if value_head else [])
        metrics = train_on_batch(model, samples, cfg, torch.optim.SGD(trainable, lr=0.1), value_head=value_head)
        results.append((scored, metrics, [p.detach().clone() for p in trainable]))
    (full, m_full, p_full), (shared, m_shared, p_shared) = results
    torch.testing.assert_close(shared[0], full[0], atol=1e-5, rtol=1e-5)
    if algorithm == "ppo":
        torch.testing.assert_close(shared[1], full[1], atol=1e-5, rtol=1e-5)
    assert m_shared["actor/pg_loss"] == pytest.approx(m_full["actor/pg_loss"], rel=1e-4, abs=1e-6)
    for a, b in zip(p_shared, p_full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_tied_embeddings_take_their_lookup_gradient_sparse_with_the_same_update(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    """With tied input and output embeddings the lookup's gradient is added sparse into the LM
    head's dense one (no second vocab x hidden tensor); the update is that of the dense path."""
    from transformers import LlamaForCausalLM

    class DenseLookup(torch.nn.Embedding):
        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
            return torch.nn.functional.embedding(input, self.weight, self.padding_idx, sparse=False)

    config = copy.deepcopy(tiny_policy.model.config)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    updated = []
    for lookup in ("sparse", "dense"):
        model = copy.deepcopy(base)
        if lookup == "dense":
            model.get_input_embeddings().__class__ = DenseLookup
        cfg = TrainConfig(micro_batch=8, max_grad_norm=1e9)
        train_on_batch(model, samples, cfg, torch.optim.SGD(model.parameters(), lr=0.1))
        assert not model.get_input_embeddings().sparse  # dense again for generation
        updated.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not torch.equal(updated[0][0], base.get_input_embeddings().weight)


def test_an_entropy_bonus_changes_the_gradient_by_exactly_its_term(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    """entropy_coef c subtracts c x the token-mean entropy of the policy from the loss: one SGD
    step at lr 1 then moves each weight by c x dH/dw more than without it, where H is computed
    here from the full logits of plain forward passes, sample by sample."""
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    coef = 0.5
    entropies = []
    for sample in samples:  # the policy's entropy at each response token, from the full logits
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        logits = tiny_policy.model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()  # predicts the response
        entropies.append(torch.distributions.Categorical(logits=logits).entropy())
    mean_entropy = torch.cat(entropies).mean()  # token-mean over the batch
    params = list(tiny_policy.model.parameters())
    d_entropy = torch.autograd.grad(mean_entropy, params, allow_unused=True)

    stepped, metrics = [], []
    for entropy_coef in (0.0, coef):
        model = copy.deepcopy(tiny_policy.model)
        cfg = TrainConfig(entropy_coef=entropy_coef, max_grad_norm=1e9)
        metrics.append(train_on_batch(model, samples, cfg, torch.optim.SGD(model.parameters(), lr=1.0)))
        stepped.append([p.detach() for p in model.parameters()])
    for m in metrics:  # reported every update (verl's actor/entropy), bonus or not
        assert m["actor/entropy"] == pytest.approx(mean_entropy.item(), rel=1e-5)
    assert metrics[0]["actor/loss"] == pytest.approx(metrics[0]["actor/pg_loss"], rel=1e-6)
    assert metrics[1]["actor/loss"] == pytest.approx(metrics[1]["actor/pg_loss"] - coef * mean_entropy.item(), rel=1e-5)
    for without, with_bonus, grad in zip(*stepped, d_entropy, strict=True):
        expected = coef * grad if grad is not None else torch.zeros_like(without)
        torch.testing.assert_close(with_bonus - without, expected, atol=1e-6, rtol=1e-4)
    assert any(grad is not None and grad.abs().max() > 1e-4 for grad in d_entropy), "the term is not trivial"


@pytest.mark.parametrize(
    ("training", "baseline"),
    [
        ({"policy_loss": "gspo"}, False),
        ({"policy_loss": "cispo", "loss_agg": "token-sum"}, False),
        ({"policy_loss": "clip_cov"}, False),
        ({"policy_loss": "kl_cov"}, False),
        ({"policy_loss": "gpg"}, False),
        ({"policy_loss": "geo_mean"}, False),
        ({"policy_loss": "reinforce", "loss_agg": "seq-mean-token-sum-norm"}, False),
        ({"adv_estimator": "opo"}, False),
        ({"adv_estimator": "grpo_passk"}, False),
        ({"adv_estimator": "remax", "learning_rate": 2e-2}, True),
    ],
    ids=lambda v: "-".join(map(str, v.values())) if isinstance(v, dict) else None,
)
def test_each_new_loss_and_estimator_raises_the_reward_on_the_toy_task(
    tiny_policy: Policy, make_sample: Callable[..., Sample], training: dict, baseline: bool
) -> None:
    """The toy task of `test_updates_raise_the_reward_on_a_toy_task` (reward: the fraction of
    "a" tokens), shorter: 12 iterations of 16 samples (ReMax 16). ReMax's baseline is the reward of one
    greedy response per prompt, generated as a rollout worker does."""
    torch.manual_seed(0)
    cfg = TrainConfig(**{"learning_rate": 1e-2, "micro_batch": 16, **training})
    optimizer = build_optimizer(tiny_policy.model, cfg)
    reward = _fraction_of_a(tiny_policy)
    engine = HFEngine(tiny_policy.model, tiny_policy.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    rewards = []
    for iteration in range(16 if baseline else 12):  # ReMax's unnormalised advantages learn slower
        samples = _generated_samples(tiny_policy, make_sample, SamplingParams(max_new_tokens=8), iteration, reward)
        if baseline:
            prompts = {s.group_id: s.prompt_ids for s in samples}
            completions = engine.generate(list(prompts.values()), greedy)
            greedy_reward = {g: reward(c.token_ids) for g, c in zip(prompts, completions, strict=True)}
            samples = [dataclasses.replace(s, baseline_reward=greedy_reward[s.group_id]) for s in samples]
        rewards.append(train_on_batch(tiny_policy.model, samples, cfg, optimizer)["reward/mean"])
    assert max(rewards[:3]) < 0.1
    assert sum(rewards[-3:]) / 3 > 0.5, rewards


@pytest.mark.parametrize(
    "training",
    [
        {"loss_agg": "token-sum"},
        {"loss_agg": "seq-mean-token-sum-norm"},
        {"policy_loss": "gspo"},
        {"policy_loss": "geo_mean"},
    ],
    ids=lambda t: next(iter(t.values())),
)
def test_micro_batching_does_not_change_the_update_of_the_sum_and_sequence_losses(
    tiny_policy: Policy, make_sample: Callable[..., Sample], training: dict
) -> None:
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    results = []
    for micro in (2, 8):
        model = copy.deepcopy(tiny_policy.model)
        cfg = TrainConfig(micro_batch=micro, max_grad_norm=1e9, **training)
        metrics = train_on_batch(model, samples, cfg, torch.optim.SGD(model.parameters(), lr=0.1))
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (m2, p2), (m8, p8) = results
    for key in m8:
        if not key.startswith("perf/"):
            assert m2[key] == pytest.approx(m8[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(p2, p8, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_mini_batches_are_a_seeded_permutation_of_the_groups(
    tiny_policy: Policy, make_sample: Callable[..., Sample]
) -> None:
    """shuffle: epoch 0 visits the groups (kept whole) in the order randperm(seed) draws; seed 1
    pairs the 4 groups into mini-batches other than in order ([1, 3] then [2, 0])."""
    samples = [
        dataclasses.replace(s, group_id=f"g{i // 2}")
        for i, s in enumerate(_random_samples(make_sample, len(tiny_policy.tokenizer)))
    ]
    order = torch.randperm(4, generator=torch.Generator().manual_seed(1)).tolist()
    assert {frozenset(order[:2]), frozenset(order[2:])} != {frozenset({0, 1}), frozenset({2, 3})}
    updated = []
    reordered = [samples[2 * g + k] for g in order for k in range(2)]
    for shuffle, batch in ((True, samples), (False, reordered), (False, samples)):
        model = copy.deepcopy(tiny_policy.model)
        cfg = TrainConfig(mini_batch=4, micro_batch=4, shuffle=shuffle, seed=1, max_grad_norm=1e9)
        train_on_batch(model, batch, cfg, torch.optim.SGD(model.parameters(), lr=0.5))
        updated.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(updated[0], updated[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(updated[0], updated[2], strict=True))


def test_remax_without_greedy_baselines_says_where_they_come_from(tiny_policy, make_sample) -> None:
    samples = [make_sample([5, 6], [7, 8], [-1.0, -1.0], 1.0)]
    cfg = TrainConfig(adv_estimator="remax")
    with pytest.raises(ValueError, match="baseline_reward.*Rollout workers add it"):
        train_on_batch(tiny_policy.model, samples, cfg, build_optimizer(tiny_policy.model, cfg))


def test_decoupled_is_metrics_and_overlong_shaping_reach_the_update(tiny_policy, make_sample) -> None:
    """Sequence-level IS weights are reported; an overlong response's reward drops linearly in
    the buffer before max_new_tokens (DAPO), which moves the loss of a lr-0 update."""
    samples = _random_samples(make_sample, len(tiny_policy.tokenizer))
    base = {"learning_rate": 0.0, "off_policy": "decoupled", "is_level": "sequence", "max_new_tokens": 11}
    plain = train_on_batch(
        tiny_policy.model, samples, TrainConfig(**base), build_optimizer(tiny_policy.model, TrainConfig())
    )
    assert 0 < plain["actor/is_weight_mean"] <= 2.0 and 0 <= plain["actor/is_capfrac"] <= 1
    assert plain["response_length/clip_ratio"] == pytest.approx(
        sum(len(s.response_ids) >= 11 for s in samples) / len(samples)
    )
    shaped = train_on_batch(
        tiny_policy.model,
        samples,
        TrainConfig(**base, overlong_buffer=6),
        build_optimizer(tiny_policy.model, TrainConfig()),
    )
    assert shaped["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], abs=1e-6)
