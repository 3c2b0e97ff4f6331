"""One rank of `test_distributed`: run under torchrun, train the tiny policy on this rank's share of
a fixed batch with a data-parallel strategy, and (rank 0) save the metrics and whole weights.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/trainer_core/rl/dist_worker.py \
        --strategy fsdp2 --scenarios grpo ppo --cache-dir CACHE --out OUT

The batch, configs and models are built here for both sides of the comparison: the test imports
`build_models`, `make_batch`, `train_config` and `single_process_order` for its one-process run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.models.loading import load_policy
from trainer_core.rl.critic import ValueHead

WORLD_SIZE = 2


@dataclass(frozen=True)
class Scenario:
    algorithm: str
    tied: bool = False  # LM head tied to the input embeddings (as SmolLM2's is)
    micro_batch_tokens: int = 0  # token-budget micro-batches: counts differ between ranks
    gradient_checkpointing: bool = False
    lora: bool = False  # a LoRA adapter trains; the reference is the base (adapter disabled)
    shared_prompts: bool = False  # a group's samples share one prompt (run once, on its KV cache)


SCENARIOS = {
    "grpo": Scenario("grpo"),
    "ppo": Scenario("ppo", micro_batch_tokens=30),
    "grpo-tied": Scenario("grpo", tied=True),
    "grpo-checkpointed": Scenario("grpo", gradient_checkpointing=True),
    "grpo-lora": Scenario("grpo", lora=True),
    "grpo-shared-prompts": Scenario("grpo", shared_prompts=True),
}


def make_batch(
    vocab: int, n: int = 8, group_size: int = 2, seed: int = 0, shared_prompts: bool = False
) -> list[Sample]:
    """`n` samples in groups of `group_size`, of varied lengths, with behaviour log-probs off the
    policy's (about -4.6 for the untrained tiny model) so that some ratios are clipped; with
    `shared_prompts` the samples of a group share their prompt, as a GRPO group's do."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        n_prompt, n_response = (int(x) for x in torch.randint(1, 12, (2,), generator=gen))
        prompt_ids = torch.randint(3, vocab, (n_prompt,), generator=gen).tolist()
        if shared_prompts and i % group_size:
            prompt_ids = samples[-1].prompt_ids
        samples.append(
            Sample(
                sample_id=f"s{i}",
                run_id="run-1",
                prompt_id=f"prompt-{i // group_size}",
                group_id=f"g{i // group_size}",
                prompt_ids=prompt_ids,
                response_ids=torch.randint(3, vocab, (n_response,), generator=gen).tolist(),
                logprobs=(-4.6 + 0.3 * torch.randn(n_response, generator=gen)).tolist(),
                reward=float(torch.rand((), generator=gen)),
                reward_source="test",
                policy_version=0,
                worker_id="worker-0",
                generation_seconds=0.1,
                created_at=1_700_000_000.5,
            )
        )
    return samples


def train_config(scenario: str) -> TrainConfig:
    # Two optimizer steps (the second one's metrics depend on the first's update), several
    # micro-batches per step (one sample each, or token-budget ones: as many as the rank that
    # needs the most), LM-head chunks of 4 tokens (a varying number per micro-batch), a KL term.
    spec = SCENARIOS[scenario]
    return TrainConfig(
        algorithm=spec.algorithm,
        learning_rate=1e-3,
        mini_batch=4,
        # A whole group per micro-batch when its samples share a prompt, so that it runs once.
        micro_batch=4 if spec.micro_batch_tokens else 2 if spec.shared_prompts else 1,
        micro_batch_tokens=spec.micro_batch_tokens,
        gradient_checkpointing=spec.gradient_checkpointing,
        logprob_chunk_tokens=4,
        kl_coef=0.1,
        max_grad_norm=0.5,
        # Each rank shuffles its own share; `single_process_order` lays out the unshuffled ones.
        shuffle=False,
    )


def build_models(cache_dir: Path, scenario: str) -> tuple[nn.Module, nn.Module, ValueHead | None]:
    """The policy, a reference that differs from it (so KL has a gradient), and for PPO a
    value head; identical in every process."""
    spec = SCENARIOS[scenario]
    model = load_policy("tiny", cache_dir=cache_dir).model
    if spec.tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    ref_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    value_head = ValueHead(model.config.hidden_size) if spec.algorithm == "ppo" else None
    if spec.lora:
        from trainer_core.models.lora import LoraSettings, apply_lora

        torch.manual_seed(2)  # the adapter's random A matrices, the same in every process
        model = apply_lora(model, LoraSettings(rank=4, alpha=8))
        with torch.no_grad():  # B starts at zero: move it, so the policy differs from its base
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05 * torch.randn(p.shape))
        ref_model = None
    return model, ref_model, value_head


def single_process_order(samples: list[Sample], cfg: TrainConfig) -> list[Sample]:
    """The batch in the order that makes one process's mini-batches those of the ranks together:
    mini-batch k of the whole batch is mini-batch k of rank 0, then of rank 1, ..."""
    from trainer_core.rl.distributed import shard_samples

    shares = [shard_samples(samples, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    per_rank = cfg.mini_batch // WORLD_SIZE
    return [
        s for start in range(0, len(shares[0]), per_rank) for share in shares for s in share[start : start + per_rank]
    ]


def main() -> None:
    from trainer_core.rl.distributed import exit_rank, init_distributed, shard_samples
    from trainer_core.rl.fsdp2 import FSDP2Strategy
    from trainer_core.rl.update import train_on_batch
    from trainer_core.rl.zero import DeepSpeedStrategy

    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)  # fsdp2 | zero1 | zero2-offload | zero3-offload ...
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ds-config", type=json.loads, default={})  # DeepSpeed config overrides
    args = parser.parse_args()

    torch.set_num_threads(1)
    env = init_distributed()
    results = {}
    for scenario in args.scenarios:
        cfg = train_config(scenario)
        model, ref_model, value_head = build_models(args.cache_dir, scenario)
        if args.strategy == "fsdp2":
            strategy = FSDP2Strategy(model, cfg, value_head=value_head, ref_model=ref_model)
            if ref_model is not None:  # sharded like the policy: each rank holds its part
                from torch.distributed.tensor import DTensor

                assert all(isinstance(p, DTensor) for p in ref_model.parameters()), "reference not sharded"
        else:
            stage, _, offload = args.strategy.removeprefix("zero").partition("-")
            strategy = DeepSpeedStrategy(
                model,
                cfg,
                zero_stage=int(stage),
                offload_optimizer=offload == "offload",
                value_head=value_head,
                ref_model=ref_model,
                config_overrides=args.ds_config,
            )
            if ref_model is not None and stage == "3":  # partitioned like the policy
                assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in ref_model.parameters()), (
                    "reference not partitioned"
                )
        batch = make_batch(model.config.vocab_size, shared_prompts=SCENARIOS[scenario].shared_prompts)
        samples = shard_samples(batch, env.rank, env.world_size)
        metrics = train_on_batch(model, samples, cfg, strategy, ref_model=ref_model, value_head=value_head)
        weights = strategy.full_state_dict()
        if value_head is not None:
            weights.update({f"value_head.{n}": p.detach().clone() for n, p in value_head.named_parameters()})
        results[scenario] = {"metrics": metrics, "weights": weights}
    if env.rank == 0:
        torch.save(results, args.out)
    exit_rank()  # as a training job's ranks end


if __name__ == "__main__":
    sys.exit(main())
