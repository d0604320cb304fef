"""The FastAPI app: routes, API-key check, and errors in OpenAI's shape.

Contract: `create_app(ctx)` returns the ASGI app for one `ServerContext`. Every path but `/health`, `/openapi.json`
included, needs `Authorization: Bearer KEY` (`bearer` in any case) when `ctx.api_key` is set. Every error a client can
cause or see, unknown paths and server bugs included, is `{"error": {"message", "type", "param", "code"}}` with a
fitting status.
"""

from __future__ import annotations

import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ringsched.server import endpoints, sglang_generate
from ringsched.server.protocol import APIError
from ringsched.server.responses import serve_responses
from ringsched.server.serving import ServerContext
from ringsched.server.tokenize import detokenize as detokenize_body
from ringsched.server.tokenize import tokenize as tokenize_body

logger = logging.getLogger("ringsched.server")


class _KeyCheck:
    """With `--api-key`, every path but `/health` (the OpenAPI schema and unknown paths too) answers 401 unless
    the request carries `Authorization: Bearer KEY`; the scheme's case does not matter (RFC 9110), the key's
    does, and it is compared in constant time so that the answer does not tell how much of it was right."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health" or self._authorized(scope):
            return await self.app(scope, receive, send)
        e = APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>` with the server's --api-key",
            code="invalid_api_key",
        )
        await JSONResponse(e.body(), status_code=401)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="ringsched", docs_url=None, redoc_url=None)
    if ctx.api_key is not None:
        app.add_middleware(_KeyCheck, api_key=ctx.api_key)
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
        return await sglang_generate.generate(request, ctx)

    _add_token_routes(app, ctx)
    return app


def _add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_responses(request, ctx)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await endpoints.tokens(request, ctx, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await endpoints.tokens(request, ctx, detokenize_body)


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
