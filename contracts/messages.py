"""Messages on the prompt queue, ``<run>.prompts``: the scheduler produces them, rollout workers consume them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A prompt as the policy is given it: text (one user turn), or chat messages
# ({"role": ..., "content": ...}) rendered with the model's chat template.
Prompt = str | list[dict[str, str]]


def prompt_text(prompt: Prompt) -> str:
    """A prompt as plain text, for what reads text (a reward model, a cache key): the text
    itself, or the messages' contents one after another."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def answer_text(answer: Any) -> str | None:
    """A reference answer as text: itself when it is text, else its JSON (None stays None)."""
    return answer if answer is None or isinstance(answer, str) else json.dumps(answer, sort_keys=True)


@dataclass(frozen=True)
class PromptMessage:
    """A prompt as queued on ``<run>.prompts``, with what its reward reads."""

    prompt_id: str
    prompt: Prompt
    answer: Any = None  # the reference answer: text or any JSON value (e.g. a code task's tests)
    data_source: str | None = None
    extra_info: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "prompt_id": self.prompt_id,
                "prompt": self.prompt,
                "answer": self.answer,
                "data_source": self.data_source,
                "extra_info": self.extra_info,
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> PromptMessage:
        d = json.loads(data)
        return cls(
            prompt_id=d["prompt_id"],
            prompt=d["prompt"],
            answer=d.get("answer"),
            data_source=d.get("data_source"),
            extra_info=d.get("extra_info"),
        )
