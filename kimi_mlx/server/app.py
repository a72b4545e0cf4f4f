"""The FastAPI app: routes, API-key auth, error shapes, body limit, health and metrics.

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`) everywhere
except /v1/messages, which answers Anthropic-shaped (`{"type": "error", "error": {"type",
"message"}}`). Every request is validated (and, for streams, queued) before the first
byte is sent, so a bad request is a 4xx JSON error, never a broken stream.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimi_mlx.server import anthropic_api, ollama_api, openai_api, responses_api
from kimi_mlx.server.common import (APIError, ClientGone, Service, max_schema_bytes,
                                    parse_body_async)
from kimi_mlx.server.metrics import CONTENT_TYPE_LATEST
from kimi_mlx.server.catalog import models_list
from kimi_mlx.server.models import model_lease
from kimi_mlx.server.schemas import (ChatRequest, CompletionRequest, CountTokensRequest, MessagesRequest,
                                    ResponsesRequest)

log = logging.getLogger(__name__)

_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
           "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/", "/openapi.json",
           "/tokenize", "/detokenize"} | ollama_api.ROUTES
WEB = Path(__file__).with_name("web")  # the chat page (index.html, app.js, vendor/)
# the page runs only its own files and talks only to this server; model output it shows is
# sanitized (DOMPurify), and this policy stops what might slip through from running
_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
             "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    415: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    """Whether `path` answers in Anthropic's dialect (errors, 401 wording)."""
    return path.startswith("/v1/messages")


def error_response(path: str, status: int, message: str, kind: str = "invalid_request_error",
                   param=None, headers=None, code=None) -> JSONResponse:
    """The error body in the dialect of `path`; `code` (OpenAI's error code) defaults to
    `kind` for statuses other than 400 and to null for a 400."""
    if ollama_api.is_ollama(path):
        return JSONResponse(ollama_api.error_body(message), status_code=status, headers=headers)
    if is_anthropic(path):
        body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, kind),
                                           "message": message}}
    else:
        if code is None and status != 400:
            code = kind
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (Content-Length or
    the bytes actually received, whichever tells first)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} "
                       "bytes (--max-body-bytes)", "request_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes "
                           "(--max-body-bytes)", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def check_json(request: Request) -> None:
    """415 unless the body is declared JSON (Content-Type: application/json, any
    parameters), as the OpenAI and Anthropic APIs require."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got "
                       f"{kind or 'none'!r}", param="content-type")


def check_key(svc: Service, request: Request) -> None:
    """401 unless the request carries the API key (Authorization: Bearer KEY, or
    x-api-key as Anthropic clients send it); compared in constant time. The wording is
    the dialect's own, which clients match on: Anthropic's `invalid x-api-key` (type
    authentication_error) on /v1/messages, OpenAI's `Incorrect API key provided: ...`
    (code invalid_api_key) elsewhere; a missing key says how to send one in both."""
    if svc.api_key is None:
        return
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    anthropic = is_anthropic(request.url.path)
    if given is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                       if not anthropic else "x-api-key header is required (missing API key)",
                       "authentication_error", code=None if anthropic else "invalid_api_key")
    if not hmac.compare_digest(given.encode(), svc.api_key.encode()):
        if anthropic:
            raise APIError(401, "invalid x-api-key", "authentication_error")
        raise APIError(401, f"Incorrect API key provided: {_masked(given)}. This server's key "
                       "is set with --api-key / --api-key-file (invalid API key).",
                       "invalid_request_error", code="invalid_api_key")


def _masked(key: str) -> str:
    """A wrong key as OpenAI echoes it: its first and last characters only."""
    return key[:3] + "*" * 4 + key[-4:] if len(key) > 10 else "*" * len(key)


class _CountRequests:
    """Pure ASGI middleware counting requests by route and status (Starlette's
    BaseHTTPMiddleware would hide a client's disconnect from the handlers)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            known = path in _ROUTES or path.startswith("/v1/models/")
            self.metrics.requests.labels(path if known else "other",
                                         str(status.get("code", 499))).inc()


def create_app(svc: Service) -> FastAPI:
    """The ASGI app serving `svc` (whose engine may still be loading: 503 until then):
    error shapes, then the info routes (/health, /metrics, /v1/models), then one route per
    API dialect (OpenAI chat and completions, Anthropic messages)."""
    app = FastAPI(title="kimi-mlx server", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.svc = svc
    _add_openapi(app, svc)
    _add_error_handlers(app)
    if svc.metrics is not None:
        app.add_middleware(_CountRequests, metrics=svc.metrics)
    _add_info_routes(app, svc)
    _add_api_routes(app, svc)
    _add_page(app)
    return app


def _add_openapi(app: FastAPI, svc: Service) -> None:
    """GET /openapi.json: FastAPI's document plus the generating routes' request and
    response schemas (`server.openapi`), top_k bounded by the loaded model's vocabulary
    (rebuilt per call: the model may load after the first)."""
    from fastapi.openapi.utils import get_openapi

    from kimi_mlx.server.common import n_vocab
    from kimi_mlx.server.openapi import add_generation_routes

    def openapi():
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        return add_generation_routes(schema, n_vocab(svc))

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the caller's dialect (`error_response`), never as a bare 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(request.url.path, e.status, e.message, e.kind, e.param, e.headers,
                              e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        msg = (f"no route {request.method} {request.url.path}" if e.status_code in (404, 405)
               else str(e.detail))
        return error_response(request.url.path, e.status_code, msg, kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(request.url.path, 400, str(e.errors()[0].get("msg")))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("request failed")
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}",
                              "server_error")


def _add_info_routes(app: FastAPI, svc: Service) -> None:
    """/health (no key: load balancers ask it), /metrics and /v1/models (key checked)."""

    @app.get("/health")
    async def health():
        """{"status", "model"} (503 with "reason" when not serving); a cluster engine
        adds "stages": [{"index", "node", "address", "layers", "ok", "reason"}]."""
        reason = svc.not_ready_reason()
        model = svc.model_ids[0] if svc.model_ids else None
        stages = svc.engine.stages() if svc.engine is not None else None
        extra = {"stages": stages} if stages is not None else {}
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason, "model": model,
                                 **extra}, status_code=503)
        return {"status": "ok", "model": model, **extra}

    @app.get("/metrics")
    async def metrics(request: Request):
        check_key(svc, request)
        if svc.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        """Every model a request may name, with what is loaded (`catalog.models_list`)."""
        check_key(svc, request)
        return {"object": "list", "data": models_list(svc)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_key(svc, request)
        svc.check_model(model_id)
        return {"id": model_id, "object": "model", "created": svc.created, "owned_by": "kimi-mlx"}


def generation_endpoint(svc: Service, schema, respond: Callable[..., Awaitable],
                        stream: Callable[..., Awaitable], media: str = "text/event-stream"):
    """One generating route: key, body size, schema, readiness are checked before
    anything is sent; then `stream(svc, req, request)` (an async iterator of SSE bytes)
    when the body asks for a stream, else `respond(svc, req, request)` (a JSON body).
    A client that leaves a non-streamed request gets 499 and its generation stops."""
    async def handler(request: Request):
        check_key(svc, request)
        check_json(request)
        raw = await read_body(request, svc.max_body_bytes)
        req = await parse_body_async(raw, schema, svc.max_body_bytes, max_schema_bytes(svc))
        async with model_lease(svc, getattr(req, "model", None)):  # loads / swaps it in
            reason = svc.not_ready_reason()
            if reason:
                raise APIError(503, f"not ready: {reason}", "overloaded_error",
                               headers={"Retry-After": "5"})
            if req.stream:
                body = await stream(svc, req, request)
                return StreamingResponse(body, media_type=media,
                                         headers={"Cache-Control": "no-cache"})
            t0 = time.perf_counter()
            try:
                out = await respond(svc, req, request)
            except ClientGone:
                log.info("client left after %.1fs; generation stopped", time.perf_counter() - t0)
                return Response(status_code=499)
            return JSONResponse(out)
    return handler


def _add_page(app: FastAPI) -> None:
    """GET / is the chat page (no key: it asks for one when the API answers 401); its
    scripts and styles are under /web/."""

    @app.head("/", include_in_schema=False)
    async def page_head():
        # clients probe the base URL at start (Claude Code sends HEAD /): a 200, no body
        return Response(status_code=200, media_type="text/html")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(WEB / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": _PAGE_CSP,
                                     "Cache-Control": "no-cache"})

    app.mount("/web", StaticFiles(directory=WEB), name="web")


def _add_api_routes(app: FastAPI, svc: Service) -> None:
    """One route per dialect's endpoint, each an adapter module's respond/stream pair."""
    responses_api.store_of(svc)  # made now, not raced for by the first two requests
    app.post("/v1/chat/completions")(generation_endpoint(
        svc, ChatRequest, openai_api.chat_response, openai_api.chat_stream))
    app.post("/v1/completions")(generation_endpoint(
        svc, CompletionRequest, openai_api.completion_response, openai_api.completion_stream))
    app.post("/v1/responses")(generation_endpoint(
        svc, ResponsesRequest, responses_api.responses_response, responses_api.responses_stream))
    app.post("/v1/messages")(generation_endpoint(
        svc, MessagesRequest, anthropic_api.messages_response, anthropic_api.messages_stream))

    _add_tokenize_routes(app, svc)
    ollama_api.add_routes(app, svc, check_key, read_body)  # /api/* and /ollama/api/*

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        check_key(svc, request)
        check_json(request)
        req = await parse_body_async(await read_body(request, svc.max_body_bytes), CountTokensRequest,
                                     svc.max_body_bytes, max_schema_bytes(svc))
        if svc.tok is None:
            raise APIError(503, "not ready: the model is loading", "overloaded_error")
        return await anthropic_api.count_tokens(svc, req)


def _add_tokenize_routes(app: FastAPI, svc: Service) -> None:
    """llama-server's POST /tokenize and /detokenize (tools/server README), which some
    clients call to count or show tokens.

    /tokenize: `content` (string, required), `add_special` (default false; K3.1 adds no
    BOS/EOS around text, so it changes nothing), `parse_special` (default true: special
    token text such as `<|open|>` becomes its id), `with_pieces` (default false) ->
    `{"tokens": [id, ...]}`, or with pieces `{"tokens": [{"id", "piece"}, ...]}` where a
    piece is its text, or its byte values when it is not valid UTF-8 on its own.
    /detokenize: `tokens` (ids in the vocabulary) -> `{"content": text}`."""
    from kimi_mlx.server.schemas import DetokenizeRequest, TokenizeRequest

    async def body_of(request: Request, schema):
        check_key(svc, request)
        check_json(request)
        req = await parse_body_async(await read_body(request, svc.max_body_bytes), schema, svc.max_body_bytes)
        if svc.tok is None:
            raise APIError(503, "not ready: the model is loading", "overloaded_error")
        return req

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await body_of(request, TokenizeRequest)
        ids = svc.tok.encode(req.content, allow_special=req.parse_special)
        if not req.with_pieces:
            return {"tokens": ids}
        pieces = []
        for t in ids:
            raw = svc.tok.decode_bytes([t])
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": t, "piece": piece})
        return {"tokens": pieces}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await body_of(request, DetokenizeRequest)
        n = len(svc.tok)
        bad = [t for t in req.tokens if not 0 <= t < n]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {n}), got {bad[:3]}", param="tokens")
        return {"content": svc.tok.decode(req.tokens)}
