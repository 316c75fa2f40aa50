"""FastAPI app factory: thin routes (parse -> engine -> format) and OpenAI error objects."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.core.kv_view import KVView
from server.metrics import Metrics
from server.openai.chat import create_chat_completion
from server.openai.completions import create_completion
from server.openai.embeddings import EmbeddingRequest, create_embedding
from server.openai.errors import APIError, error_response, install_error_handlers
from server.openai.lora_adapters import install_lora_routes
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from server.openai.render import render_chat_completion, render_completion
from server.openai.responses import create_response
from server.openai.responses_protocol import ResponsesRequest
from server.openai.responses_store import ResponseStore
from server.openai.score import RerankRequest, ScoreRequest, create_rerank, create_score
from server.openai.serving import ServingContext
from server.openai.tokenization import detokenize, tokenize
from server.openai.tokenizer_info import tokenizer_info
from server.playground import install_offline_docs, install_playground
from server.request_id import RequestIdMiddleware

__all__ = ["APIError", "VERSION", "build_app", "error_response"]

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


def build_app(
    engine: AsyncEngine,
    metrics: Metrics,
    tool_call_parser: str | None = None,  # None: tool_choice "auto" is refused
    kv_view: KVView | None = None,
    responses_store_size: int = 1000,
    tool_call_format: str | None = None,  # the chat template's call format (default: the parser's)
) -> FastAPI:
    """The app over the engine's facade (model name, tokenizer, limits all come from it).

    kv_view: the engine's KV view for the playground, or None for none (--disable-playground).
    """
    # FastAPI's own /docs and /redoc load their scripts from a CDN: ours are served locally.
    app = FastAPI(title="pagedserve", version=VERSION, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    ctx = ServingContext.build(engine)
    ctx.tool_call_parser = tool_call_parser
    ctx.tool_call_format = tool_call_format or tool_call_parser
    ctx.responses = ResponseStore(responses_store_size)
    app.state.serving = ctx
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    _add_operational_routes(app, engine, metrics)
    _add_model_routes(app, engine, ctx)
    if getattr(engine, "runner_type", "generate") == "pooling":
        _add_refused_generation_routes(app, ctx)
    else:
        _add_generation_routes(app, ctx)
    _add_pooling_routes(app, ctx)
    _add_tokenizer_routes(app, engine, ctx)
    install_lora_routes(app, engine)  # with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING

    install_offline_docs(app)
    if kv_view is not None:
        install_playground(app, kv_view)

    return app


def _add_operational_routes(app: FastAPI, engine: AsyncEngine, metrics: Metrics) -> None:
    """/health, /ping, /version and /metrics."""

    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError:
            return error_response(503, "engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    # /ping answers as /health does (vLLM has both, GET and POST).
    app.add_api_route("/health", health, methods=["GET", "POST"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_model_routes(app: FastAPI, engine: AsyncEngine, ctx: ServingContext) -> None:
    """/v1/models and /v1/models/{model}: the served model's card, then each LoRA adapter's
    (its `parent` the base model, as vLLM lists them)."""

    def model_cards() -> list[ModelCard]:
        root = str(engine.model_dir)
        card = ModelCard(id=ctx.model_name, root=root, max_model_len=ctx.max_model_len)
        if getattr(engine, "mm_processor", None) is not None:  # a vision-language model
            card.input_modalities = ["text", "image"]
        cards = [card]
        for lora in getattr(engine, "lora_adapters", ()):
            # vLLM keeps base_model_name only where it names a served model, else the first
            cards.append(ModelCard(id=lora.name, root=lora.path, parent=ctx.model_name))
        return cards

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return next(card for card in model_cards() if card.id == model)


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The OpenAI generation endpoints: completions, chat completions, responses."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await create_completion(ctx, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await create_chat_completion(ctx, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest):
        return await create_response(ctx, body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return ctx.responses.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return ctx.responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict:
        return ctx.responses.input_items(response_id, order, limit, after)


def _add_pooling_routes(app: FastAPI, ctx: ServingContext) -> None:
    """/v1/embeddings, /v1/score and /v1/rerank (400s on a generating model)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await create_embedding(ctx, body)

    async def score(body: ScoreRequest):
        return await create_score(ctx, body)

    async def rerank(body: RerankRequest):
        return await create_rerank(ctx, body)

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])


def _add_refused_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """On a pooling model the generation endpoints answer 400 saying what it serves."""

    async def refuse(request: Request):
        path = request.url.path
        raise APIError(
            400,
            f"{path} needs a generating model; `{ctx.model_name}` is a pooling model "
            "(--runner pooling): it serves /v1/embeddings",
            param="model",
        )

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, refuse, methods=["POST"])


def _add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, ctx: ServingContext) -> None:
    """/tokenize, /detokenize, /tokenizer_info and the render endpoints."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(ctx, body)

    # vLLM's render endpoints: what /v1/completions and /v1/chat/completions would run
    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest) -> list[dict]:
        return await render_completion(ctx, body)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(body: ChatCompletionRequest) -> dict:
        return await render_chat_completion(ctx, body)

    info = tokenizer_info(engine.tokenizer)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        """The tokenizer's configuration (vLLM's shape), as lm-eval's remote tokenizer reads it."""
        return info
