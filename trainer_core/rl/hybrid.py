"""The hybrid engine of colocated runs: one copy of the actor's weights serving both generation
and training in one process on one device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.algos import AdaptiveKLController
from trainer_core.engines.hf import Completion, HFEngine, SamplingParams
from trainer_core.models.loading import Policy
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.micro_batches import with_auto_micro_batch
from trainer_core.rl.strategy import build_optimizer
from trainer_core.rl.update import train_on_batch


class HybridEngine:
    """One set of actor weights serving generation and training.

    `generate` samples from `model` with `HFEngine` (eval mode, no grad, KV cache); `train`
    updates the same parameters in place with `train_on_batch`. No copy is made at the switch,
    so no weight sync is needed and the rollout after an update samples from the new weights.
    """

    def __init__(
        self,
        policy: Policy,
        cfg: TrainConfig,
        *,
        value_head: ValueHead | None = None,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.policy = policy
        self.cfg = cfg
        self.value_head = value_head
        self.ref_model = ref_model
        self.rollout = HFEngine(policy.model, policy.tokenizer)
        self.optimizer = build_optimizer(policy.model, cfg, value_head)
        self.kl_controller: AdaptiveKLController | None = None  # with training.kl_target

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, drawn from the global torch RNG (checkpointed with the run)."""
        completions = self.rollout.generate(prompts, params)
        assert completions is not None  # no should_stop given
        return completions

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One update of the shared weights on `samples`; micro_batch 0 (auto) is sized once,
        on the first batch."""
        self.cfg = with_auto_micro_batch(self.cfg, self.model, samples, value_head=self.value_head)
        return train_on_batch(
            self.model,
            samples,
            self.cfg,
            self.optimizer,
            ref_model=self.ref_model,
            value_head=self.value_head,
            kl_controller=self.kl_controller,
        )
