"""FastAPI app: thin routes (parse -> engine -> format), OpenAI error objects, SSE streams."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from engine.outputs import RequestOutput
from server.metrics import Metrics
from server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from server.request_id import RequestIdMiddleware, current_request_id

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str, param: str | None = None, headers=None):
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def build_app(engine: AsyncEngine, tokenizer, model_name: str, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION)
    app.state.engine, app.state.tokenizer, app.state.metrics = engine, tokenizer, metrics
    max_model_len = engine.engine.config.max_model_len
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

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=model_name, root=str(engine.engine.model_dir), max_model_len=max_model_len
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        _check_model(body.model, model_name)
        prompt_ids = _prompt_token_ids(body.prompt, tokenizer)
        params = _sampling_params(body)
        request_id = f"cmpl-{current_request_id()}"
        try:
            stream = engine.generate(request_id, prompt_ids, params)
            first = await anext(stream)  # refusals surface here, before any SSE header
        except QueueFullError as e:
            raise APIError(503, str(e), "ServiceUnavailableError") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), "ServiceUnavailableError") from e
        except ValueError as e:
            raise APIError(400, str(e), "BadRequestError") from e
        if body.stream:
            sse = _stream_completion(first, stream, request_id, model_name, body, len(prompt_ids))
            return StreamingResponse(sse, media_type="text/event-stream")
        return await _full_completion(first, stream, request_id, model_name, len(prompt_ids))

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return error_response(e.status, e.message, e.type, e.param, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        # Summarize without echoing the (possibly huge) input back.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, msg, "BadRequestError", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "BadRequestError"
        return error_response(e.status_code, str(e.detail), kind)


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")


def _prompt_token_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        return tokenizer.encode(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt:
        raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
    raise APIError(400, "batched prompts are not supported yet", "BadRequestError", "prompt")


def _sampling_params(body: CompletionRequest):
    if body.n != 1:
        raise APIError(400, "n > 1 is not supported yet", "BadRequestError", "n")
    try:
        return body.to_sampling_params()
    except ValueError as e:
        raise APIError(400, str(e), "BadRequestError", getattr(e, "param", None)) from e


async def _full_completion(first, stream, request_id, model_name, num_prompt_tokens):
    text, num_tokens, last = first.outputs[0].text, len(first.outputs[0].token_ids), first
    async for out in stream:
        text += out.outputs[0].text
        num_tokens += len(out.outputs[0].token_ids)
        last = out
    choice = CompletionChoice(index=0, text=text, finish_reason=last.outputs[0].finish_reason)
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_tokens,
        total_tokens=num_prompt_tokens + num_tokens,
    )
    return CompletionResponse(id=request_id, model=model_name, choices=[choice], usage=usage)


async def _stream_completion(
    first: RequestOutput,
    stream: AsyncIterator[RequestOutput],
    request_id: str,
    model_name: str,
    body: CompletionRequest,
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    created = CompletionResponse(id=request_id, model=model_name, choices=[]).created
    num_tokens = 0

    def chunk(out: RequestOutput) -> str:
        c = out.outputs[0]
        choice = CompletionChoice(index=0, text=c.text, finish_reason=c.finish_reason)
        resp = CompletionResponse(
            id=request_id, created=created, model=model_name, choices=[choice]
        )
        return f"data: {resp.model_dump_json(exclude_none=False)}\n\n"

    try:
        out = first
        while True:
            num_tokens += len(out.outputs[0].token_ids)
            if out.outputs[0].text or out.finished:
                yield chunk(out)
            if out.finished:
                break
            out = await anext(stream)
        if body.stream_options and body.stream_options.include_usage:
            usage = UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_tokens,
                total_tokens=num_prompt_tokens + num_tokens,
            )
            resp = CompletionResponse(
                id=request_id, created=created, model=model_name, choices=[], usage=usage
            )
            yield f"data: {resp.model_dump_json()}\n\n"
    except EngineDeadError as e:
        err = ErrorResponse(error=ErrorInfo(message=str(e), type="InternalServerError", code=500))
        yield f"data: {json.dumps(err.model_dump())}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
