"""The interactive API docs (/docs): Swagger UI with its files served from here, from the
swagger-ui-bundle package, so that the page loads nothing from another origin."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

router = APIRouter(include_in_schema=False)

# The files the page loads; nothing else of the package (its sample page loads a third-party document).
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}


@router.get("/docs")
async def docs(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} API",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
        # Swagger UI would otherwise send the document's URL to an online validator.
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/docs/assets/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "Not Found")
    return FileResponse(
        swagger_ui_path / name, media_type=ASSETS[name], headers={"Cache-Control": "public, max-age=86400"}
    )
