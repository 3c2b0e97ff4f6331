"""Messages on the prompt queue, ``<run>.prompts``: the scheduler produces them, rollout workers consume them."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptMessage:
    """A prompt as queued on ``<run>.prompts``."""

    prompt_id: str
    prompt: str
    answer: str | None

    def encode(self) -> bytes:
        return json.dumps({"prompt_id": self.prompt_id, "prompt": self.prompt, "answer": self.answer}).encode()

    @classmethod
    def decode(cls, data: bytes) -> PromptMessage:
        d = json.loads(data)
        return cls(prompt_id=d["prompt_id"], prompt=d["prompt"], answer=d.get("answer"))
