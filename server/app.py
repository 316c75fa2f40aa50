"""FastAPI app factory: thin routes (parse -> engine -> format) and OpenAI error objects."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.kv_view import KVView
from server.metrics import Metrics
from server.playground import install_offline_docs, install_playground
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from server.request_id import RequestIdMiddleware
from server.serving_chat import create_chat_completion
from server.serving_completions import create_completion
from server.serving_engine import ServingContext
from server.serving_errors import APIError, error_response
from server.serving_tokenization import detokenize, tokenize
from server.tokenizer_info import tokenizer_info

__all__ = ["APIError", "VERSION", "build_app", "error_response"]

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


def build_app(
    engine: AsyncEngine,
    tokenizer,
    model_name: str,
    metrics: Metrics,
    kv_view: KVView | None = None,
) -> FastAPI:
    """kv_view: the engine's KV view, or None for no playground (`--disable-playground`)."""
    # FastAPI's own /docs and /redoc load their scripts from a CDN: ours are served locally.
    app = FastAPI(title="pagedserve", version=VERSION, docs_url=None, redoc_url=None)
    app.state.engine, app.state.tokenizer, app.state.metrics = engine, tokenizer, metrics
    ctx = ServingContext.build(engine, tokenizer, model_name)
    app.state.serving = ctx
    _install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, "engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> ModelCard:
        root = str(engine.engine.model_dir)
        return ModelCard(id=model_name, root=root, max_model_len=ctx.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await create_completion(ctx, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await create_chat_completion(ctx, body)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(ctx, body)

    info = tokenizer_info(tokenizer)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        """The tokenizer's configuration (vLLM's shape), as lm-eval's remote tokenizer reads it."""
        return info

    install_offline_docs(app)
    if kv_view is not None:
        install_playground(app, kv_view)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return error_response(e.status, e.message, e.type, e.param, headers, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        # Name the field and the rule; never echo the (possibly huge) input or server paths.
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", "BadRequestError")
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, msg[:500], "BadRequestError", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "BadRequestError"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, "internal server error", "InternalServerError")
