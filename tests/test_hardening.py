"""Connection-level limits and the edges (loopback): slow clients, descriptors, faults, shutdown.

Servers start together in one module fixture so their (slow) imports overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ScriptedEngine, ServerProcess, build_byte_tokenizer, metric_value

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_S, BODY_S, KEEP_ALIVE_S = 2.0, 2.0, 3.0
NOFILE = 200  # the descriptor limit of the "fds" server: its connection cap is NOFILE - 128
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _bound(seconds: float) -> float:
    """A wall-clock bound as stated on a machine to ourselves, stretched by oversubscription."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


class LimitedServer(ServerProcess):
    """ServerProcess under `ulimit -n nofile` (set in the child before exec)."""

    def __init__(self, model: str, nofile: int, *args: str, env: dict | None = None) -> None:
        from conftest import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", model, "--port", str(self.port), *args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve-{self.port}.log"
        self._log = open(self.log_path, "w")
        limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
            env={**os.environ, **(env or {})},
        )

    def full_log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    model = str(tiny_model_dir)
    paced = {"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:5"}
    deadlines = ("--timeout-request-header", str(HEADER_S), "--timeout-request-body", str(BODY_S))
    procs = {
        # Short deadlines; every import after start-up shows in its log (PYTHONPROFILEIMPORTTIME).
        "edge": ServerProcess(
            model,
            *("--dtype", "float32", "--api-key", KEY, *deadlines),
            *("--timeout-keep-alive", str(KEEP_ALIVE_S), "--max-request-body-bytes", "4096"),
            *("--limit-concurrency", "2"),
            env={**paced, "PYTHONPROFILEIMPORTTIME": "1"},
        ),
        "default": ServerProcess(model, "--dtype", "float32", "--shutdown-timeout", "0", env=paced),
        # Also the one the SIGSEGV test kills, after the descriptor test (file order).
        "fds": LimitedServer(
            model, NOFILE, "--dtype", "float32", "--timeout-request-header", "60", env=paced
        ),
    }
    try:
        for s in procs.values():
            s.wait_ready(300)
        yield procs
    finally:
        for s in procs.values():
            s.stop()


def assert_error_object(status: int, headers, body: bytes, expected: int) -> dict:
    """One shape everywhere: {"error": {message, type, param, code}}, code a string or null."""
    assert status == expected, body[:300]
    payload = json.loads(body)
    error = payload["error"]
    assert set(payload) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    if status == 503:
        assert int(headers["retry-after"]) >= 1
    return error


# ---- raw loopback clients -----------------------------------------------------------------------
async def _read_until_closed(reader: asyncio.StreamReader, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    data = b""
    async with asyncio.timeout(limit):
        while chunk := await reader.read(4096):
            data += chunk
    return data, time.monotonic()


async def _slow_client(port: int, kind: str, limit: float) -> tuple[bytes, float]:
    """idle: never a byte; header: headers one byte per 0.2 s; body: the body likewise."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()

    async def dribble(data: bytes) -> None:
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.2)

    try:
        if kind == "header":
            feeder = asyncio.create_task(dribble(head))
        elif kind == "body":
            writer.write(head)
            feeder = asyncio.create_task(dribble(b'{"prompt": "' + b"x" * 980))
        else:
            feeder = None
        data, closed_at = await _read_until_closed(reader, limit)
        if feeder is not None:
            feeder.cancel()
        return data, closed_at - t0
    finally:
        writer.close()


def _parse_raw_response(data: bytes) -> tuple[int, dict, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split()[1]), headers, body


# ---- slow clients -------------------------------------------------------------------------------
def test_slowloris_clients_are_closed_at_their_deadlines_while_others_are_served(servers):
    server = servers["edge"]
    before = httpx.get(server.url + "/metrics", timeout=10).text

    async def scenario():
        slow = [_slow_client(server.port, kind, 30) for kind in ("idle", "header", "body")]
        slow_task = asyncio.gather(*slow)
        served, t_end = 0, time.monotonic() + HEADER_S + 1
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
            while time.monotonic() < t_end:  # normal requests go on while the slow ones hang
                body = {"prompt": "hi", "max_tokens": 2}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                served += 1
        return await slow_task, served

    (idle, header, body), served = asyncio.run(scenario())
    assert served >= 2
    # Closed at the deadline (not before), within a bound the machine's load stretches.
    for (_, closed_after), limit in ((idle, HEADER_S), (header, HEADER_S), (body, BODY_S)):
        assert limit - 0.3 < closed_after < limit + _bound(2.0)
    assert idle[0] == b""  # nothing sent: closed quietly
    for data in (header[0], body[0]):
        assert_error_object(*_parse_raw_response(data), 408)
    after = httpx.get(server.url + "/metrics", timeout=10).text
    name = "pagedserve:http_slow_clients_closed_total"
    for phase in ("idle", "header", "body"):
        grew = metric_value(after, name, {"phase": phase}) - metric_value(
            before, name, {"phase": phase}
        )
        assert grew == 1, phase


def test_keep_alive_connection_is_reused_then_closed_quietly_after_the_idle_timeout(servers):
    server = servers["edge"]

    async def scenario():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        try:
            writer.write(request)
            first = await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(KEEP_ALIVE_S - 1.5)
            writer.write(request)  # reused inside the keep-alive window
            second = await reader.readuntil(b"\r\n\r\n")
            t0 = time.monotonic()
            rest, closed_at = await _read_until_closed(reader, 30)
            return first, second, rest, closed_at - t0
        finally:
            writer.close()

    first, second, rest, idle_for = asyncio.run(scenario())
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    assert rest == b"" and KEEP_ALIVE_S - 0.3 < idle_for < KEEP_ALIVE_S + _bound(2.0)


def test_pooled_client_reuse_never_races_the_keep_alive_close(servers):
    """Pools keep idle connections 5 s (httpx) to 15 s (aiohttp); the server keeps them longer."""
    server = servers["default"]

    async def reuse(expiry: float, gap: float) -> list[tuple[int, object]]:
        limits = httpx.Limits(keepalive_expiry=expiry)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            seen = []
            for pause in (gap, 0.0):
                r = await client.get("/health")
                local = r.extensions["network_stream"].get_extra_info("client_addr")
                seen.append((r.status_code, local))
                await asyncio.sleep(pause)
            return seen

    async def scenario():
        # Reuse just inside httpx's own expiry, and after uvicorn's 5 s default would have closed.
        return await asyncio.gather(reuse(5.0, 4.9), reuse(15.0, 6.5))

    for seen in asyncio.run(scenario()):
        assert [status for status, _ in seen] == [200, 200]
        # One connection (one local port) served both: none was closed under the pool.
        assert len({local for _, local in seen}) == 1


# ---- limits -------------------------------------------------------------------------------------
def test_concurrency_limit_answers_503_with_retry_after_and_spares_health(servers):
    server = servers["edge"]  # --limit-concurrency 2

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            body = {"prompt": "hold", "stream": True, **LONG}
            started = [asyncio.Event(), asyncio.Event()]

            async def holder(i: int):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        started[i].set()
                        await asyncio.sleep(30)

            holders = [asyncio.create_task(holder(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            health = await client.get("/health")
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return refused, health

    refused, health = asyncio.run(scenario())
    error = assert_error_object(refused.status_code, refused.headers, refused.content, 503)
    assert "concurrency" in error["message"] and health.status_code == 200


def test_low_descriptor_limit_answers_503_or_refuses_never_500_and_logs_boundedly(servers):
    server = servers["fds"]  # ulimit -n NOFILE: more connections than it may hold
    log_start = len(server.full_log())

    async def hold(holders: list) -> None:
        try:
            holders.append(await asyncio.open_connection("127.0.0.1", server.port))
        except OSError:
            pass

    async def one_request(client: httpx.AsyncClient) -> int | str:
        try:
            r = await client.get("/v1/models")
        except httpx.TransportError as e:  # refused, reset or closed: allowed
            return type(e).__name__
        if r.status_code == 503:
            assert_error_object(r.status_code, r.headers, r.content, 503)
        return r.status_code

    async def scenario():
        holders: list = []
        await asyncio.gather(*(hold(holders) for _ in range(NOFILE + 50)))
        await asyncio.sleep(1.0)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=20, limits=limits) as client:
            during = await asyncio.gather(*(one_request(client) for _ in range(40)))
        for _, writer in holders:
            writer.close()
        t0, after = time.monotonic(), None
        while time.monotonic() - t0 < _bound(10.0):  # the server is itself again at once
            try:
                after = httpx.get(server.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                after = None
            if after == 200:
                break
            await asyncio.sleep(0.2)
        return len(holders), during, after, time.monotonic() - t0

    num_held, during, after, recovered_in = asyncio.run(scenario())
    assert num_held == NOFILE + 50  # all in the backlog or accepted: more than the server may hold
    rejected = metric_value(
        httpx.get(server.url + "/metrics", timeout=10).text,
        "pagedserve:http_connections_rejected_total",
        {"reason": "limit_connections"},
    )
    assert rejected > 0
    assert 500 not in during and all(s in (200, 503) or isinstance(s, str) for s in during)
    assert 503 in during
    assert after == 200 and recovered_in < _bound(10.0)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    log = server.full_log()[log_start:]
    assert "Traceback" not in log and "internal server error" not in log
    assert log.count("refusing new ones") <= 3  # one line per 10 s however many were refused
    assert log.count("out of system resource") <= 3


# ---- crashes and shutdown -----------------------------------------------------------------------
def test_sigsegv_mid_stream_leaves_the_stack_in_the_log_and_a_nonzero_exit(servers):
    server = servers["fds"]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"prompt": "crash me", "stream": True, **LONG}
            lines = []
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not lines:
                            server.proc.send_signal(signal.SIGSEGV)
                        lines.append(line)
            except httpx.TransportError:
                pass
            return lines

    lines = asyncio.run(scenario())
    assert lines  # it was streaming when the fault hit
    code = server.proc.wait(_bound(30))
    assert code == -signal.SIGSEGV  # dies by the signal: an orchestrator sees a failure
    log = server.log_path.read_text()
    # faulthandler: every Python thread's stack (the engine loop's and the event loop's).
    assert "Fatal Python error: Segmentation fault" in log
    assert log.count("(most recent call first)") >= 2 and 'File "' in log


def test_shutdown_timeout_0_ends_in_flight_streams_with_an_error_at_once(servers):
    server = servers["default"]  # --shutdown-timeout 0

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started, signalled = asyncio.Event(), []

            async def stream(i: int):
                body = {"prompt": f"abort {i}", "stream": True, **LONG}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        started.set()
                        if line:
                            lines.append(line)
                    return [x.removeprefix("data: ") for x in lines], time.monotonic()

            streams = [asyncio.create_task(stream(i)) for i in range(2)]
            await started.wait()
            await asyncio.sleep(0.3)
            signalled.append(time.monotonic())
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams), signalled[0]

    results, t_signal = asyncio.run(scenario())
    for events, ended in results:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"]
        assert error["code"] is None or isinstance(error["code"], str)
        assert ended - t_signal < _bound(2.0)  # at once, not after 900 tokens
    assert server.proc.wait(30) == 0


# ---- validation edges and the error shape ------------------------------------------------------
@pytest.fixture(scope="module")
def scripted():
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.metrics import Metrics

    return TestClient(build_app(ScriptedEngine(build_byte_tokenizer()), Metrics("fake")))


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": [[False]]}, "prompt"),
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/v1/completions", {"prompt": [[5], [6, True]]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [False]},
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"true": 1}}, "logit_bias"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": [5, False]}, "tokens"),
    ],
)
def test_boolean_token_ids_are_refused_naming_the_field(scripted, path, body, field):
    r = scripted.post(path, json=body)
    error = assert_error_object(r.status_code, r.headers, r.content, 400)
    assert error["param"] == field, error


def test_integer_token_ids_are_still_served(scripted):
    assert scripted.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 2}).is_success
    ids = scripted.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
    assert scripted.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hi"}


def test_every_error_path_has_one_shape(servers):
    server = servers["edge"]  # --api-key, 4 KiB body limit
    url, cases = server.url, []
    with httpx.Client(base_url=url, timeout=30) as c:
        cases.append((c.post("/v1/completions", json={"prompt": "x"}), 401))
        cases.append((c.get("/nope", headers=AUTH), 404))
        cases.append(
            (c.post("/v1/completions", json={"model": "no", "prompt": "x"}, headers=AUTH), 404)
        )
        cases.append((c.post("/v1/completions", content=b"{", headers=AUTH), 400))
        cases.append((c.post("/v1/completions", json={"prompt": [[True]]}, headers=AUTH), 400))
        big = {"prompt": "x" * 5000}
        cases.append((c.post("/v1/completions", json=big, headers=AUTH), 413))
    for r, status in cases:
        assert_error_object(r.status_code, r.headers, r.content, status)
    # 503s (loading, draining, limits) and 408s are checked where they happen: the loading
    # switch and drain in test_reliability/test_server, limits and deadlines above.
    scripted_engine = ScriptedEngine(build_byte_tokenizer())
    scripted_engine.queue_full = True
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.metrics import Metrics

    full = TestClient(build_app(scripted_engine, Metrics("fake")))
    r = full.post("/v1/completions", json={"prompt": "x"})
    assert_error_object(r.status_code, r.headers, r.content, 503)


def test_no_module_is_imported_on_the_request_path(servers):
    """An import opens files; under descriptor exhaustion a first-use import fails a request."""
    server = servers["edge"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 2})
        c.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 2, "stream": True})
        c.post("/v1/chat/completions", json=chat)
        c.post("/v1/chat/completions", json={**chat, "stream": True, "logprobs": True})
        c.post("/tokenize", json={"prompt": "hi"})
        c.post("/tokenize", json={"messages": chat["messages"]})
        c.post("/detokenize", json={"tokens": [104]})
        for path in ("/v1/models", "/v1/models/x", "/version", "/metrics", "/health/", "/nope"):
            c.get(path)
        c.post("/v1/completions", content=b"{")
        c.post("/v1/completions", json={"prompt": "x" * 5000})
        c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    # Whatever ran since start-up (these requests, other tests' requests, engine steps).
    since_ready = server.log_path.read_text().partition("ready: /health answers 200")[2]
    late = [line for line in since_ready.splitlines() if "import time:" in line]
    assert late == [], late[:20]
