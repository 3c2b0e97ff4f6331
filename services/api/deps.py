"""Dependencies of the routes: the backends and catalog built at start-up, and auth."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status

from services.config import Settings, get_settings
from services.cost.catalog import PriceCatalog
from services.wiring import Backends


def get_backends(request: Request) -> Backends:
    return request.app.state.backends


def get_catalog(request: Request) -> PriceCatalog:
    return request.app.state.catalog


def require_token(
    settings: Annotated[Settings, Depends(get_settings)],
    authorization: Annotated[str | None, Header()] = None,
) -> None:
    if settings.api_token is None:
        return
    expected = f"Bearer {settings.api_token}"
    if authorization is None or not secrets.compare_digest(authorization, expected):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "send `Authorization: Bearer <SPOTRL_API_TOKEN>`")


BackendsDep = Annotated[Backends, Depends(get_backends)]
CatalogDep = Annotated[PriceCatalog, Depends(get_catalog)]
