"""Request validation errors as an HTTP server of spotrl returns them (the API and the reward
service): the field and the rule, never the client's text."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse

# A location part (a field name or an index) is cut to this many characters.
MAX_LOC_CHARS = 100


def _short(part: object) -> object:
    return part[:MAX_LOC_CHARS] if isinstance(part, str) else part


def rendered(error: dict) -> dict:
    """One validation error as it goes back: the field and the rule. An unknown field's name is
    the client's text, so its error names the model that holds it and says "unknown field"."""
    loc = list(error["loc"])
    if error["type"] == "extra_forbidden":
        return {"loc": [_short(part) for part in loc[:-1]], "msg": "unknown field", "type": error["type"]}
    return {"loc": [_short(part) for part in loc], "msg": error["msg"], "type": error["type"]}


def unprocessable(errors: Iterable[dict]) -> JSONResponse:
    """The 422 response for pydantic's ``errors``, each ``rendered``."""
    return JSONResponse(status_code=422, content={"detail": [rendered(e) for e in errors]})
