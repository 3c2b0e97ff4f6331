"""Domain errors become HTTP status codes here, and only here.

No response repeats what the client sent: a validation error names the field and the rule, not
the value.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from services.control.api.service import BodyTooLargeError, InvalidCursorError, PodNotOfRunError, SpecFieldError
from services.control.api.upload_slots import TooManyUploadsError
from services.control.cost.planner import PlanError
from services.core.validation_errors import unprocessable
from services.domain.prompts import InvalidPromptsError
from services.ports.state.state_store import IllegalTransitionError, RunNotFoundError

_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _methods_at(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` serves at ``path``, asked of the routes themselves
    (``matches``): FastAPI keeps an included router's routes inside it, not in ``app.router.routes``."""

    def served(method: str) -> bool:
        scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": [], "query_string": b""}
        return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)

    return [method for method in _METHODS if served(method)]


def _unprocessable(loc: tuple | list, message: str, kind: str = "value_error") -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": [{"loc": list(loc), "msg": message, "type": kind}]})


def add_error_handlers(app: FastAPI) -> None:
    """Map each domain error the routes let rise to its status code and body."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            # Starlette names the methods of one route; a path is served by a route per method.
            headers["Allow"] = ", ".join(_methods_at(app, request.url.path))
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail}, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return unprocessable(exc.errors())

    @app.exception_handler(RunNotFoundError)
    async def _not_found(_: Request, exc: RunNotFoundError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": "no such run"})

    @app.exception_handler(PodNotOfRunError)
    async def _no_pod(_: Request, exc: PodNotOfRunError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_404_NOT_FOUND, content={"detail": "no such pod of this run"})

    @app.exception_handler(IllegalTransitionError)
    async def _conflict(_: Request, exc: IllegalTransitionError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_409_CONFLICT, content={"detail": str(exc)})

    @app.exception_handler(InvalidCursorError)
    async def _bad_cursor(_: Request, exc: InvalidCursorError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_400_BAD_REQUEST, content={"detail": str(exc)})

    @app.exception_handler(BodyTooLargeError)
    async def _too_large(_: Request, exc: BodyTooLargeError) -> JSONResponse:
        return JSONResponse(status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, content={"detail": str(exc)})

    @app.exception_handler(TooManyUploadsError)
    async def _too_many_uploads(_: Request, exc: TooManyUploadsError) -> JSONResponse:
        return JSONResponse(
            status_code=status.HTTP_429_TOO_MANY_REQUESTS,
            content={"detail": str(exc)},
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    @app.exception_handler(SpecFieldError)
    async def _bad_field(_: Request, exc: SpecFieldError) -> JSONResponse:
        return _unprocessable(exc.loc, str(exc))

    @app.exception_handler(PlanError)
    async def _no_plan(_: Request, exc: PlanError) -> JSONResponse:
        return _unprocessable(("body", *exc.loc), str(exc))

    @app.exception_handler(InvalidPromptsError)
    async def _bad_prompts(_: Request, exc: InvalidPromptsError) -> JSONResponse:
        return _unprocessable(("body", "prompts"), str(exc))
