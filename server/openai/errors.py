"""The OpenAI error object, the one builder of its body, and the one place handlers are installed.

Every error the server sends, from a route, the ASGI guard, the loading switch or mid-stream,
is `error_body(...)`: `{"error": {"message", "type", "param", "code"}}` with `code` a string or
null as OpenAI's schema says. Every 503 carries `Retry-After: RETRY_AFTER_S`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # every 503 (loading, draining, queue full, engine gone): retry in a second

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere under a route; the app turns it into an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "BadRequestError")


def error_body(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    info = ErrorInfo(
        message=message, type=type_ or _TYPES.get(status, "BadRequestError"), param=param, code=code
    )
    return ErrorResponse(error=info).model_dump()


def error_bytes(status: int, message: str, type_: str | None = None, code: str | None = None):
    """error_body as JSON bytes, for the raw ASGI senders (guard, loading switch, SSE tails)."""
    return json.dumps(error_body(status, message, type_, code=code)).encode()


def retry_headers(status: int) -> dict[str, str] | None:
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    headers: dict | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = error_body(status, message, type_, param, code)
    all_headers = {**(retry_headers(status) or {}), **(headers or {})}
    return JSONResponse(body, status_code=status, headers=all_headers or None)


def engine_error(e: Exception) -> APIError:
    """An engine exception as the error object a client sees."""
    from engine.async_engine import EngineDeadError, QueueFullError  # torch: not at listen time

    if isinstance(e, APIError):
        return e
    if isinstance(e, (QueueFullError, EngineDeadError)):
        return APIError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
    return APIError(500, f"internal error: {e!r}", "InternalServerError")


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route can raise, as an OpenAI error object (the only handlers)."""
    from engine.async_engine import EngineDeadError

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, code=e.code)

    @app.exception_handler(EngineDeadError)  # after a response was chosen: shutdown, crash
    async def engine_dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), "ServiceUnavailableError")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # Name the field and the rule; never echo the (possibly huge) input or server paths.
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        content_type = request.headers.get("content-type", "")
        if not loc and "json" not in content_type.lower():  # plain `curl -d` sends a form
            msg = "send JSON with Content-Type: application/json"
            got = f" (got Content-Type: {content_type[:100]})" if content_type else ""
            return error_response(400, msg + got, "BadRequestError")
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
