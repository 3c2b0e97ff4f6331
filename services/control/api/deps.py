"""Dependencies of the routes: the backends and catalog built at start-up, and who is calling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.control.api.auth import NO_AUTH, Principal, TokenBook
from services.control.api.kept import Kept
from services.control.api.upload_slots import UploadSlots
from services.core.config import Settings
from services.ports.prices.catalog import PriceCatalog
from services.ports.wiring import Backends

# Declared in the OpenAPI document as the `bearer` scheme; missing credentials are ours to refuse.
bearer = HTTPBearer(
    scheme_name="bearer", auto_error=False, description="A token the operator issued with `spotrl token add`."
)
T = TypeVar("T")
UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="spotrl"'}


# The dependencies are `async def`: they only read app state (the tokens file's stat at most), and
# a plain `def` one would cost a hop through the thread pool on every request.
async def get_backends(request: Request) -> Backends:
    return request.app.state.backends


async def get_catalog(request: Request) -> PriceCatalog:
    return request.app.state.catalog


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_upload_slots(request: Request) -> UploadSlots:
    """The app's upload slots, made from its settings at the first upload (on the event loop: no race)."""
    slots: UploadSlots | None = getattr(request.app.state, "upload_slots", None)
    if slots is None:
        settings: Settings = request.app.state.settings
        slots = UploadSlots(
            per_server=settings.max_concurrent_uploads, per_tenant=settings.max_concurrent_uploads_per_tenant
        )
        request.app.state.upload_slots = slots
    return slots


def _principal(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The caller of a token in the tokens file; everyone is the admin when there is none."""
    tokens: TokenBook | None = request.app.state.tokens
    if tokens is None:
        return NO_AUTH
    principal = tokens.principal(credentials.credentials) if credentials is not None else None
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "send `Authorization: Bearer <token>` with a token the operator issued (`spotrl token add`)",
            headers=UNAUTHORIZED,
        )
    return principal


async def get_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    return _principal(request, credentials)


@dataclass(frozen=True)
class Caller:
    """Who is calling, and what the app built at start-up that the runs' routes read."""

    principal: Principal
    backends: Backends
    catalog: PriceCatalog
    kept: Kept
    settings: Settings
    threads: Executor  # of the routes' blocking work

    async def run(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """``fn(**kwargs)`` on one of the app's threads: the state store's calls block."""
        return await asyncio.get_running_loop().run_in_executor(self.threads, partial(fn, **kwargs))

    async def run_on_runs(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """``run(fn, ...)`` for a service call on the runs: given the caller's principal and the
        app's backends, price catalog and kept reads besides ``kwargs``."""
        return await self.run(
            fn, backends=self.backends, catalog=self.catalog, principal=self.principal, kept=self.kept, **kwargs
        )


async def get_caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Caller:
    """The caller and the app's parts in one dependency: FastAPI spends some 25 us of CPU solving
    each dependency of each request, a tenth of what reading a kept run costs."""
    state = request.app.state
    return Caller(
        _principal(request, credentials), state.backends, state.catalog, state.kept, state.settings, state.threads
    )


async def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if not principal.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this needs an admin token")
    return principal


BackendsDep = Annotated[Backends, Depends(get_backends)]
CatalogDep = Annotated[PriceCatalog, Depends(get_catalog)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
CallerDep = Annotated[Caller, Depends(get_caller)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
UploadSlotsDep = Annotated[UploadSlots, Depends(get_upload_slots)]
