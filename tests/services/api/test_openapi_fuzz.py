"""schemathesis over every operation of the API, with data that fits the OpenAPI document and data
that breaks it: no server error, and every response as the document says (status, headers,
body). Bounded in examples per operation, so the whole sweep takes seconds.

schemathesis parametrizes at collection time, so the app under test is built here, on a home
of its own (the lifespan it starts lasts for the test process)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings as hypothesis_settings
from schemathesis.generation import GenerationMode

from services.api.auth import add_token
from services.api.main import create_app
from services.config import Settings

EXAMPLES_PER_OPERATION = 100

_home = Path(tempfile.mkdtemp(prefix="spotrl-fuzz-"))
(_home / "data").mkdir()
TOKEN = add_token(_home / "tokens.json", tenant="fuzz", admin=True)
APP = create_app(
    Settings(home=_home / "home", tokens_file=_home / "tokens.json", data_dirs=str(_home / "data")), with_scheduler=False
)



@schemathesis.serializer("application/x-ndjson")
def _jsonl(ctx, value) -> bytes:
    """A prompt-set upload: the generated string as it is; any other value (negative data) as JSON."""
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()


schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
schema.config.generation.update(modes=list(GenerationMode), max_examples=EXAMPLES_PER_OPERATION, deterministic=True)
schema.config.update(headers={"Authorization": f"Bearer {TOKEN}"})
# Data that breaks the document may also be refused for its size, before it is read.
rejection = schema.config.checks.negative_data_rejection
rejection.expected_statuses = [*rejection.expected_statuses, "413"]
# A run spec has rules across fields that JSON Schema cannot state (batch_samples a multiple of
# samples_per_prompt, catalog instance types, each reward's own arguments, server paths): data
# that fits the document may still be refused with 422, which names the rule. Likewise a page
# cursor is opaque: one the API did not hand out is a documented 400.
acceptance = schema.config.checks.positive_data_acceptance
acceptance.expected_statuses = [*acceptance.expected_statuses, "400", "422"]


@schema.parametrize()
@hypothesis_settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case) -> None:
    case.call_and_validate()
