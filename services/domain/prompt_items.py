"""A prompt set's items as a run spec holds them (inline, or each row of a prompt set file once
read): text or chat messages and what the reward reads, and the order a run takes them in."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    JsonValue,
    field_validator,
)

from contracts.messages import PromptMessage
from services.domain.spec_fields import STRICT

MAX_INLINE_PROMPTS = 10_000

# The JSON a prompt item carries for its reward beyond the text (`answer`, `extra_info`), as
# serialised: a code task's test cases fit; a line of a prompt set holds at most MAX_LINE_CHARS.
MAX_REWARD_DATA_CHARS = 200_000
MAX_PROMPT_CHARS = 100_000


def check_prompt_source(v: list[PromptItem] | str, what: str) -> list[PromptItem] | str:
    """A spec's prompt set as given: a non-empty inline list, or a path or store:// URI."""
    if isinstance(v, list) and not v:
        raise ValueError(f"at least one {what} is needed")
    if isinstance(v, str) and not v.strip():
        raise ValueError("give a JSONL path, a store:// URI or an inline list")
    return v


class ChatMessage(BaseModel):
    """One turn of a chat prompt, as verl's datasets and OpenAI's API write it."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: str = Field(max_length=MAX_PROMPT_CHARS, description="What is said.")


def _bounded_json(value: JsonValue, field: str) -> JsonValue:
    if value is not None and len(json.dumps(value)) > MAX_REWARD_DATA_CHARS:
        raise ValueError(f"{field} is longer than {MAX_REWARD_DATA_CHARS} characters as JSON")
    return value


class PromptItem(BaseModel):
    """One prompt of a prompt set: its text or chat messages, and what its reward reads."""

    model_config = STRICT

    prompt: str | Annotated[list[ChatMessage], Field(min_length=1, max_length=64)] = Field(
        description="Text given to the policy as a user turn, or chat messages rendered with the model's chat template."
    )
    answer: JsonValue = Field(
        default=None,
        description="Reference answer (verl's reward_model.ground_truth): text, or any JSON value the reward reads, such as a "
        "code task's test cases.",
    )
    data_source: str | None = Field(
        default=None, max_length=256, description="Which dataset the item comes from; passed to the reward."
    )
    extra_info: dict[str, JsonValue] | None = Field(
        default=None, description="Anything else the reward reads (verl's extra_info)."
    )

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: str | list[ChatMessage]) -> str | list[ChatMessage]:
        chars = len(v) if isinstance(v, str) else sum(len(m.content) for m in v)
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return v

    def message(self, prompt_id: str) -> PromptMessage:
        """The item as queued for the rollout workers (``<run>.prompts``)."""
        return PromptMessage(prompt_id=prompt_id, **self.model_dump(mode="json"))

    @field_validator("answer")
    @classmethod
    def _check_answer(cls, v: JsonValue) -> JsonValue:
        return _bounded_json(v, "answer")

    @field_validator("extra_info")
    @classmethod
    def _check_extra_info(cls, v: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        return _bounded_json(v, "extra_info")  # type: ignore[return-value]


def cycled_messages(items: Sequence[PromptItem], start: int, count: int) -> list[PromptMessage]:
    """Prompts ``start`` to ``start + count`` of a run, as queued for rollout: a run goes over its
    prompt set again and again (epochs) until it ends, so prompt ``i`` is item ``i % len(items)``,
    with that index as its prompt id (the same prompt has the same id in every epoch). The
    scheduler publishes them so and a colocated run takes its batches so, so that both train on
    the same prompts in the same order."""
    return [items[i % len(items)].message(str(i % len(items))) for i in range(start, start + count)]


class DatasetFields(BaseModel):
    """Where each row of a prompt set file keeps what a prompt item needs (verl's ``data.prompt_key``
    and ``reward_model.ground_truth``). Every other field of a row reaches the reward in its
    ``extra_info``; a row's own ``extra_info`` object is merged in and wins."""

    model_config = STRICT

    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        max_length=256,
        description="The field holding each row's prompt: text or chat messages.",
    )
    answer_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[^.]+(\.[^.]+)*$",
        description="The dotted path of each row's answer, e.g. reward_model.ground_truth; by default reward_model.ground_truth "
        "where a row has it, else `answer`. The top-level field it lies in is not passed on in extra_info.",
    )
