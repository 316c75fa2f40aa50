"""One ASGI guard in front of the app: drain, auth, limits, body deadline, disconnects, timeout.

Pure ASGI (no BaseHTTPMiddleware) so cancelling the route on a disconnect or a timeout reaches
the engine's async generator, whose `finally` aborts the request and frees its KV blocks:

    client --> drain 503 --> auth 401 --> concurrency 503 --> body limit 413 / deadline 408
           --> [route | disconnect watcher | timer]

Connection-level deadlines (idle, headers) and the connection cap sit below, in
server/connection_guard.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

from server.auth import is_authorized, is_public
from server.connection_guard import ConnectionStats, RateLimitedLog
from server.openai.errors import RETRY_AFTER_S, error_bytes

logger = logging.getLogger(__name__)

Scope = dict
Message = dict

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Probes are often written with a trailing slash; these answer exactly as the plain paths.
PATH_ALIASES = {"/health/": "/health", "/ping/": "/ping"}
# Cheap routes a load balancer or scraper needs most when the server is saturated.
UNCAPPED_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


@dataclass(frozen=True)
class GuardSettings:
    api_key: str | None = None
    protect_metrics: bool = False
    max_request_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float | None = None  # seconds from arrival to the last byte; None: no limit
    timeout_request_body: float | None = 60.0  # seconds from the headers to the body's end
    limit_concurrency: int | None = None  # requests in flight beyond which new ones get 503


class ServerState:
    """What the lifecycle supervisor, the guard and the connection protocol share (event loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_inflight = 0
        self.connections = ConnectionStats()
        self.log = RateLimitedLog()


async def send_error(
    send, status: int, message: str, type_: str, headers=(), code: str | None = None
) -> None:
    """An OpenAI error object straight onto the ASGI channel (no app behind it answered)."""
    body = error_bytes(status, message, type_, code)
    all_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if status == 503:
        all_headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app, settings: GuardSettings, state: ServerState) -> None:
        self.app, self.settings, self.state = app, settings, state

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in PATH_ALIASES:
            path = PATH_ALIASES[path]
            scope = {**scope, "path": path, "raw_path": path.encode()}
        if self.state.draining and path != "/metrics":
            close = [(b"connection", b"close")]
            await send_error(send, 503, "server is shutting down", "ServiceUnavailableError", close)
            return
        key = self.settings.api_key
        if key and not is_public(path, self.settings.protect_metrics):
            if not is_authorized(scope.get("headers", []), key):
                challenge = [(b"www-authenticate", b"Bearer")]
                msg = "Invalid or missing API key (Authorization: Bearer <key>)."
                await send_error(
                    send, 401, msg, "AuthenticationError", challenge, code="invalid_api_key"
                )
                return
        limit = self.settings.limit_concurrency
        if limit is not None and self.state.num_inflight >= limit and path not in UNCAPPED_PATHS:
            self.state.connections.rejected["limit_concurrency"] += 1
            msg = f"{limit} requests in flight: refusing new ones with 503"
            self.state.log.warning("limit_concurrency", msg)
            busy = "the server is at its concurrency limit"
            await send_error(send, 503, busy, "ServiceUnavailableError")
            return
        self.state.num_inflight += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.state.num_inflight -= 1

    async def _guarded(self, scope: Scope, receive, send) -> None:
        try:
            async with asyncio.timeout(self.settings.timeout_request_body):
                body = await self._read_body(scope, receive)
        except TimeoutError:
            self.state.connections.slow_clients_closed["body"] += 1
            limit = self.settings.timeout_request_body
            msg = f"request body not received within {limit:g} s"
            await send_error(send, 408, msg, "TimeoutError", [(b"connection", b"close")])
            return
        except BodyTooLarge:
            limit = self.settings.max_request_body_bytes
            msg = (
                f"request body exceeds the limit of {limit} bytes; the server's "
                "--max-request-body-bytes raises it"
            )
            await send_error(send, 413, msg, "RequestTooLargeError", [(b"connection", b"close")])
            return
        if body is None:  # the client left while sending
            return
        if _has_lone_surrogate(body):
            msg = "request body has a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode"
            await send_error(send, 400, msg, "BadRequestError")
            return
        await _RequestRun(self.app, scope, body, receive, send).run(self.settings.request_timeout)

    async def _read_body(self, scope: Scope, receive) -> bytes | None:
        limit = self.settings.max_request_body_bytes
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
                raise BodyTooLarge
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _RequestRun:
    """Runs the route beside a disconnect watcher and an optional timer; the first to end wins."""

    def __init__(self, app, scope: Scope, body: bytes, receive, send) -> None:
        self.app, self.scope, self.body = app, scope, body
        self.receive, self.send = receive, send
        self.body_replayed = False
        self.disconnected = asyncio.Event()
        self.started = self.complete = self.is_stream = False

    async def app_receive(self) -> Message:
        if not self.body_replayed:
            self.body_replayed = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def app_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.is_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)

    async def watch_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()

    async def run(self, timeout: float | None) -> None:
        route = asyncio.ensure_future(self.app(self.scope, self.app_receive, self.app_send))
        watcher = asyncio.ensure_future(self.watch_disconnect())
        try:
            done, _ = await asyncio.wait(
                {route, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if route in done:
                route.result()  # re-raise a route's error for the server to log
            elif watcher in done and not self.complete:
                await _cancel(route)  # the client left: cancelling the route aborts the request
            elif watcher in done:
                await route
            else:
                await _cancel(route)
                await self.answer_timeout(timeout)
        finally:
            for task in (route, watcher):
                if not task.done():
                    await _cancel(task)

    async def answer_timeout(self, timeout: float) -> None:
        msg = f"request exceeded the server's request timeout of {timeout:g} s"
        logger.info("aborting %s: %s", self.scope["path"], msg)
        if not self.started:
            await send_error(self.send, 408, msg, "TimeoutError", [(b"connection", b"close")])
            return
        if self.complete:
            return
        tail = b""
        if self.is_stream:  # the stream's own shape for errors, then its usual terminator
            tail = b"data: " + error_bytes(408, msg, "TimeoutError") + b"\n\ndata: [DONE]\n\n"
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})


def _has_lone_surrogate(body: bytes) -> bool:
    """JSON may spell unpaired surrogates; no tokenizer or UTF-8 writer downstream can take them."""
    if not _SURROGATE_ESCAPE.search(body):  # a cheap scan; parse only on a hit
        return False
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False  # not JSON: the route's own parser answers 400
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - a cancelled route may still fail on its way out
        logger.exception("request task failed while being cancelled")
