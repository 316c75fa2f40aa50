"""Process lifecycle: listen before loading, watch the engine, drain on SIGTERM, exit honestly.

start --> listening, /health 503 (loading) --> ready, /health 200
  ready --SIGTERM--> draining: new requests 503, in-flight ones run on --> exit 0
                     (after --shutdown-timeout the rest are failed, then exit 0;
                      --shutdown-timeout 0 fails them at once)
  ready --engine loop died or hung--> pending requests fail, /health 503 --> exit 1
         (a model worker that died or stopped answering counts as the engine; either way the
          worker processes are stopped before the exit, none outlives the server)
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn

from server.connection_guard import install_accept_error_log
from server.middleware import ServerState, send_error

logger = logging.getLogger(__name__)

# Modules the request path would otherwise import on first use (anyio's streams, a codec): an
# import needs descriptors, and a first request under descriptor exhaustion must not fail on
# one. tests/test_hardening.py runs every route under PYTHONPROFILEIMPORTTIME to keep this whole.
REQUEST_PATH_MODULES = (
    "anyio._core._sockets",
    "anyio._core._streams",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "encodings.unicode_escape",
)
EXIT_GRACE_S = 2.0  # after an engine failure: streams flush their error event, /health reads 503
SUPERVISE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class LifecycleSettings:
    shutdown_timeout: float = 30.0
    engine_stall_timeout: float = 60.0


class SwitchApp:
    """Answers 503 while the model loads, then hands every request to the real app."""

    def __init__(self) -> None:
        self.app = None
        self.stage = "starting"  # what the loader is doing, for the 503 body

    def set_stage(self, stage: str) -> None:
        self.stage = stage

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            msg = f"the model is still loading: {self.stage}"
            await send_error(send, 503, msg, "ServiceUnavailableError")


class DrainingServer(uvicorn.Server):
    """SIGTERM / SIGINT start a drain instead of an immediate stop; a second SIGINT forces it."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not recorded in _captured_signals: uvicorn would re-raise it at the end
        # and the process would die by the signal instead of exiting 0.
        if self.state.draining and sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
            return
        if not self.state.draining:
            logger.info("received signal %d: draining in-flight requests", sig)
            self.state.draining = True
            self.drain_started = time.monotonic()


class Loader:
    """Builds the engine and app on a daemon thread so the port answers while torch loads."""

    def __init__(self, build: Callable[[], tuple[object, object]]) -> None:
        self.build = build
        self.result: tuple[object, object] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="model-loader", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.build()
        except ValueError as e:  # a user error (flags vs model): one line, no traceback
            print(f"pagedserve: error: {e}", file=sys.stderr, flush=True)
            self.error = e
        except BaseException as e:  # noqa: BLE001 - reported by the supervisor
            logger.exception("loading failed")
            self.error = e


async def supervise(
    server: DrainingServer, switch: SwitchApp, loader: Loader, settings: LifecycleSettings
) -> int:
    """Polls the loader, the engine and the drain; returns the process exit code."""
    engine = None
    while not server.should_exit:
        await asyncio.sleep(SUPERVISE_INTERVAL_S)
        if engine is None and loader.error is not None:
            server.should_exit = True
            return 1
        if engine is None and loader.result is not None:
            engine, switch.app = loader.result
            logger.info("ready: /health answers 200")
        if engine is not None and _engine_failed(engine, settings.engine_stall_timeout):
            await asyncio.sleep(EXIT_GRACE_S)
            server.should_exit = True
            return 1
        if server.state.draining and await _drain_done(server, engine, settings):
            server.should_exit = True
    return 0


def _engine_failed(engine, stall_timeout: float) -> bool:
    from engine.async_engine import EngineDeadError

    if not engine.is_alive:
        dead_worker = engine.dead_worker
        logger.error("%s: exiting with status 1", dead_worker or "engine loop is not running")
        engine.fail(EngineDeadError(dead_worker or "the engine loop died"))  # no-op if told
        return True
    if engine.is_hung(stall_timeout):
        msg = f"the engine loop made no progress for {stall_timeout:g} s"
        logger.error("%s: failing pending requests, exiting with status 1", msg)
        engine.fail(EngineDeadError(msg))
        return True
    return False


async def _drain_done(server: DrainingServer, engine, settings: LifecycleSettings) -> bool:
    if server.state.num_inflight == 0:
        return True
    if time.monotonic() - server.drain_started < settings.shutdown_timeout:
        return False
    from engine.async_engine import EngineDeadError

    logger.warning(
        "shutdown timeout (%g s): failing %d in-flight request(s)",
        settings.shutdown_timeout,
        server.state.num_inflight,
    )
    if engine is not None:
        engine.fail_requests(EngineDeadError("the server is shutting down"))
    deadline = time.monotonic() + EXIT_GRACE_S  # let the error events reach their clients
    while server.state.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(SUPERVISE_INTERVAL_S)
    return True


async def run_server(
    config: uvicorn.Config,
    switch: SwitchApp,
    state: ServerState,
    build: Callable[[], tuple[object, object]],
    settings: LifecycleSettings,
) -> int:
    """Serves until drained or failed; returns the exit code. Loading starts once listening."""
    install_accept_error_log(asyncio.get_running_loop(), state.log)
    for name in REQUEST_PATH_MODULES:
        importlib.import_module(name)
    server = DrainingServer(config, state)
    loader = Loader(build)
    serve_task = asyncio.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.02)
    if serve_task.done():  # could not bind, for example
        serve_task.result()
        return 1
    loader.thread.start()
    code = await supervise(server, switch, loader, settings)
    await serve_task
    if loader.result is not None:
        # after the drain a clean stop; after a failure (a hung loop) the join is short and the
        # model's workers are killed either way
        loader.result[0].shutdown(timeout=5.0 if code == 0 else 1.0)
    return code
