"""The error responses of the API's operations, for the OpenAPI document: each operation lists
the ones it can return."""

from __future__ import annotations

from typing import Any

from services.api.schemas import ErrorPublic

_MEANINGS = {
    400: "A query parameter this API cannot use (e.g. a cursor it did not return).",
    401: "No token, or one the operator did not issue; the response carries `WWW-Authenticate: Bearer`.",
    403: "The token is not an admin's.",
    404: "No such run visible to this token.",
    409: "The run's status does not allow it (e.g. cancelling an ended run).",
    413: "The request body is larger than this server accepts; nothing of it was read.",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorPublic, "description": _MEANINGS[code]} for code in codes}
