"""X-Request-Id: honour the caller's id or mint one, echo it on the response, hand it to routes.

Routes name their engine request `cmpl-<id>` with `current_request_id()`, so the header, the
response body's `id` and the per-request log line all carry the same id.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
_VALID_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII: safe in logs and in an SSE id
_current: ContextVar[str | None] = ContextVar("pagedserve_request_id", default=None)


def current_request_id() -> str:
    """The id of the HTTP request being served (a fresh one outside a request)."""
    return _current.get() or uuid.uuid4().hex


def incoming_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == HEADER:
            text = value.decode("latin-1").strip()
            return text if _VALID_ID.fullmatch(text) else None
    return None


class RequestIdMiddleware:
    """Pure ASGI, so streaming responses pass through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = incoming_request_id(scope.get("headers", [])) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((HEADER, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        token = _current.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
