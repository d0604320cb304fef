"""The FastAPI app: routes, API-key check, and errors in OpenAI's shape.

Contract: `create_app(ctx)` returns the ASGI app for one `ServerContext`. Every endpoint but `/health` needs
`Authorization: Bearer KEY` when `ctx.api_key` is set. Every error a client can cause or see, unknown paths and
server bugs included, is `{"error": {"message", "type", "param", "code"}}` with a fitting status.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringsched.server import endpoints
from ringsched.server.protocol import APIError
from ringsched.server.serving import ServerContext

logger = logging.getLogger("ringsched.server")


def _key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check_key(request: Request) -> None:
        if api_key is None or request.url.path == "/health":
            return
        given = request.headers.get("authorization", "")
        # Constant-time: the comparison must not tell an attacker how much of the key was right.
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the server's --api-key",
                code="invalid_api_key",
            )  # fmt: skip

    return check_key


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="ringsched", dependencies=[Depends(_key_check(ctx.api_key))], docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        c = ctx.client
        if c.healthy and c.supervisor.alive and c.accepting:
            return JSONResponse({"status": "ok"})
        reason = c.failure or "the server is shutting down"
        return JSONResponse({"status": "unhealthy", "error": reason}, status_code=503)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": started,
            "owned_by": "ringsched",
            "max_model_len": ctx.limits.max_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(ctx.client), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await endpoints.completions(request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await endpoints.chat_completions(request, ctx)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await endpoints.generate(request, ctx)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("internal error in %s %s", request.method, request.url.path)
        message = f"internal server error: {type(e).__name__}: {e}"
        body = {"error": {"message": message, "type": "internal_server_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=500)
