"""Connection-level limits under uvicorn's HTTP/1.1 protocol: deadlines, a cap, quiet logs.

uvicorn times only the keep-alive gap after a response: a connection that never sends a byte, or
dribbles its headers, holds a descriptor for ever. This subclass of uvicorn's h11 protocol keeps
one deadline per connection, chosen by where the connection's current request stands:

    accepted ------------ --timeout-request-header --> closed (no byte: quietly; else 408)
    response sent ------- --timeout-keep-alive ------> closed quietly (pooled clients reuse it)
      first byte of the next request -- --timeout-request-header --> 408, closed
    headers complete: the ASGI guard times the body (--timeout-request-body), then the route runs
    more than --limit-connections open: 503 + Retry-After, closed

Header and body deadlines count in `pagedserve:http_slow_clients_closed_total{phase}`, refusals in
`pagedserve:http_connections_rejected_total{reason}`. Warnings that a flood would repeat (refusals,
`accept()` out of descriptors) go through RateLimitedLog: one line per interval with a count.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.openai.errors import RETRY_AFTER_S, error_bytes

logger = logging.getLogger(__name__)

SLOW_PHASES = ("idle", "header", "body")  # idle: a new connection that never sent a byte
REJECT_REASONS = ("limit_connections", "limit_concurrency")
FD_RESERVE = 128  # descriptors kept for the process itself (logs, model files, pipes)
LOG_INTERVAL_S = 10.0
REJECT_LINGER_S = 1.0  # a refused client gets this long to read its 503 before the close


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_keep_alive: float = 65.0
    timeout_request_header: float = 20.0
    timeout_request_body: float = 60.0
    limit_connections: int | None = None  # None: the descriptor limit less FD_RESERVE
    limit_concurrency: int | None = None  # None: bounded by the connections only

    def max_connections(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        by_fds = max(16, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else 1 << 20
        return by_fds if self.limit_connections is None else min(self.limit_connections, by_fds)


@dataclass
class ConnectionStats:
    """Counters the protocol and the ASGI guard bump (event-loop thread) and /metrics reads."""

    num_open: int = 0
    slow_clients_closed: dict[str, int] = field(default_factory=lambda: _zeros(SLOW_PHASES))
    rejected: dict[str, int] = field(default_factory=lambda: _zeros(REJECT_REASONS))


def _zeros(keys: tuple[str, ...]) -> dict[str, int]:
    return dict.fromkeys(keys, 0)


class RateLimitedLog:
    """At most one warning per key and interval; the next one says how many were left out."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        left_out = self._suppressed.pop(key, 0)
        extra = f" ({left_out} more in the last {self.interval:g} s)" if left_out else ""
        logger.warning("%s%s", message, extra)


def raw_error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response with the OpenAI error object, for before any request."""
    body = error_bytes(status, message)
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json"]
    head += [f"content-length: {len(body)}", "connection: close"]
    if status == 503:
        head.append(f"retry-after: {RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus per-connection deadlines and the open-connection cap.

    Built per server by `protocol_class(limits, stats, log)`; uvicorn instantiates it per
    connection exactly as it does its own.
    """

    limits: ConnectionLimits
    stats: ConnectionStats
    log: RateLimitedLog
    max_open: int

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._rejected = False
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        if self.stats.num_open >= self.max_open:
            self._reject(transport)
            return
        self.stats.num_open += 1
        super().connection_made(transport)
        self._set_phase("first")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._rejected:
            return
        self.stats.num_open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the request of a refused connection is read and dropped
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._set_phase("keep_alive")
            self._follow_request()  # a pipelined request may already be buffered

    # ---- deadlines ---------------------------------------------------------------------------
    def _follow_request(self) -> None:
        if self.conn.their_state is not h11.IDLE:
            self._set_phase(None)  # headers are in: the guard and --request-timeout take over
        elif self.conn.trailing_data[0] and self._phase == "keep_alive":
            self._set_phase("header")  # the next request started: its headers have a deadline

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        self._cancel_timer()
        self._phase = phase
        timeouts = {
            "first": self.limits.timeout_request_header,
            "header": self.limits.timeout_request_header,
            "keep_alive": self.limits.timeout_keep_alive,
        }
        if phase is not None:
            self._timer = self.loop.call_later(timeouts[phase], self._expire, phase)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing() or phase != self._phase:
            return
        if phase != "keep_alive":  # an idle pooled connection is no slow client
            started = bool(self.conn.trailing_data[0])
            self.stats.slow_clients_closed["header" if started else "idle"] += 1
            if started:
                limit = self.limits.timeout_request_header
                msg = f"request headers not received within {limit:g} s"
                self.transport.write(raw_error_response(408, "Request Timeout", msg))
        self.transport.close()

    # ---- the cap -----------------------------------------------------------------------------
    def _reject(self, transport: asyncio.Transport) -> None:
        self._rejected = True
        self.transport = transport
        self.stats.rejected["limit_connections"] += 1
        self.log.warning(
            "limit_connections", f"{self.max_open} connections open: refusing new ones with 503"
        )
        transport.write(raw_error_response(503, "Service Unavailable", "too many open connections"))
        # Half-close and linger: closing with the request unread would reset the connection
        # before the client reads its 503.
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self.loop.call_later(REJECT_LINGER_S, transport.abort)


def protocol_class(
    limits: ConnectionLimits, stats: ConnectionStats, log: RateLimitedLog
) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol bound to one server's limits and counters (uvicorn's `http=`)."""
    attrs = {"limits": limits, "stats": stats, "log": log, "max_open": limits.max_connections()}
    return type("BoundGuardedH11Protocol", (GuardedH11Protocol,), attrs)


def install_accept_error_log(loop: asyncio.AbstractEventLoop, log: RateLimitedLog) -> None:
    """asyncio reports every failed accept() (EMFILE...) through the loop: once per interval."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = context.get("message", "")
        if message.startswith("socket.accept() out of system resource"):
            log.warning("accept", f"{message}: {context.get('exception')!r}")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
