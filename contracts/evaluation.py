"""An eval job's result: how policy version N scored on the run's held-out prompts, written by
the eval pod, read by the scheduler.

Stored as JSON at ``runs/<run>/evals/v<N>.json`` (``services.domain.names.eval_result_key``), written
last: its presence means the eval of vN is done (a retried eval pod that finds it exits).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvalResult(BaseModel):
    """One policy version's held-out evaluation."""

    model_config = ConfigDict(extra="forbid")

    policy_version: int = Field(ge=0, description="The version evaluated; 0 is the run's base model.")
    mean_score: float = Field(description="Mean reward of every response to every held-out prompt.")
    metrics: dict[str, float] = Field(description="The spec's eval metrics by name: `mean`, `pass@k`.")
    prompts: int = Field(ge=1, description="Held-out prompts evaluated.")
    samples: int = Field(ge=1, description="Responses generated and scored in all.")
    reward_failures: int = Field(default=0, ge=0, description="Responses whose reward failed (each scored 0).")
    seconds: float = Field(ge=0.0, description="Wall time of the eval's work (loading, generating, scoring).")
    ended_at: float = Field(description="Unix time the result was written.")

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> EvalResult:
        return cls.model_validate_json(data)
