"""The error responses of the API's operations, for the OpenAPI document: each operation lists
the ones it can return."""

from __future__ import annotations

from typing import Any

from services.control.api.schemas import ErrorPublic, ValidationErrorPublic

_MEANINGS = {
    400: "A request this API cannot read: a body it cannot parse, or a query parameter it cannot use (a cursor it did not return).",
    401: "No token, or one the operator did not issue; the response carries `WWW-Authenticate: Bearer`.",
    403: "The token is not an admin's.",
    404: "No such run visible to this token (or, for a pod, no such pod of that run).",
    409: "The run's status does not allow it (e.g. cancelling an ended run).",
    413: "The request body is larger than this server accepts; nothing of it was read.",
    422: "The request breaks a rule: each field and the rule it breaks.",
    429: "The server is reading as many uploads as it allows (of this tenant, or in all); try again after `Retry-After` seconds.",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {
        code: {"model": ValidationErrorPublic if code == 422 else ErrorPublic, "description": _MEANINGS[code]}
        for code in codes
    }


def json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``errors`` for an operation that answers other than JSON (an HTML page): FastAPI would
    document its error bodies in that media type, but they are JSON like every other error."""
    return {
        code: {
            "description": _MEANINGS[code],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        for code, model in ((c, ValidationErrorPublic if c == 422 else ErrorPublic) for c in codes)
    }
