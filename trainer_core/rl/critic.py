"""The PPO critic: a value head on the policy's hidden states, or on a backbone of its own."""

from __future__ import annotations

from torch import Tensor, nn
from transformers import PreTrainedModel


class ValueHead(nn.Module):
    """PPO critic: Linear(hidden, 1) on a last hidden state.

    Shared (the default): on the policy's own hidden states, detached, so the critic's loss
    never disturbs the actor and costs one linear layer. Separate: on the hidden states of its
    own `backbone` (a causal LM, typically a copy of the base model), which it trains too: a
    critic with its own features, at the cost of a second model's weights and passes.
    """

    def __init__(self, hidden_size: int, backbone: PreTrainedModel | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.linear = nn.Linear(hidden_size, 1)
        # Start by predicting 0: the first advantages are then plain discounted returns,
        # not returns minus the noise of a random critic.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """`(batch, seq, hidden)` -> values `(batch, seq)`."""
        if self.backbone is None:
            hidden_states = hidden_states.detach()
        return self.linear(hidden_states.float()).squeeze(-1)
