"""Disconnects, preemption pressure, overload, health under faults, graceful shutdown (loopback).

Servers start together in one module fixture so their (slow) imports overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest
from conftest import ServerProcess, metric_value, wait_idle

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _bound(seconds: float) -> float:
    """A wall-clock bound as stated on a machine to ourselves, stretched by oversubscription."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _spawn(model_dir, *args: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(str(model_dir), "--dtype", "float32", *args, env=env)


def _health_until_ready(server: ServerProcess, timeout: float = 300.0) -> list[int]:
    """Every /health status seen from spawn until the first 200 (connection refused skipped)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited {server.proc.returncode}:\n{server.log()}")
        try:
            seen.append(httpx.get(server.url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            pass
        if seen and seen[-1] == 200:
            return seen
        time.sleep(0.05)
    raise TimeoutError(f"not ready in {timeout}s:\n{server.log()}")


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    crash = {"PAGEDSERVE_FAULT_INJECT": "crash_after_steps:15"}
    stall = {"PAGEDSERVE_FAULT_INJECT": "stall_after_steps:15"}
    # A floor under every step, so streams that tests race against (drain, shutdown, queue
    # holders) outlast those races on a fast idle machine as well as on a loaded one.
    paced = {"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:5"}
    procs = {
        "roomy": _spawn(
            tiny_model_dir, "--max-model-len", "1024", "--shutdown-timeout", "120", env=paced
        ),
        "tight": _spawn(tiny_model_dir, "--max-model-len", "64", "--num-gpu-blocks-override", "16"),
        "overload": _spawn(
            tiny_model_dir,
            *("--max-num-seqs", "1", "--max-num-queued-reqs", "3", "--shutdown-timeout", "2"),
            env=paced,
        ),
        "crash": _spawn(tiny_model_dir, env=crash),
        "stall": _spawn(tiny_model_dir, "--engine-stall-timeout", "3", env=stall),
    }
    try:
        seen = {name: _health_until_ready(s) for name, s in procs.items()}
        yield procs, seen
    finally:
        for s in procs.values():
            s.stop()


# ---- raw loopback clients -----------------------------------------------------------------------
async def _post_and_give_up(port: int, body: dict, after: float) -> bytes:
    """Sends a completion request on a raw socket, reads for `after` seconds, then hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    received = b""
    try:
        async with asyncio.timeout(after):
            while chunk := await reader.read(4096):
                received += chunk
    except TimeoutError:
        pass
    finally:
        writer.close()
    return received


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# ---- health before load -------------------------------------------------------------------------
def test_health_is_503_while_loading_then_200(servers):
    _, seen = servers
    codes = seen["roomy"]  # polled from spawn on; the others were polled once it was ready
    assert codes[0] == 503 and set(codes[:-1]) == {503} and codes[-1] == 200


# ---- disconnects --------------------------------------------------------------------------------
def test_disconnect_storm_frees_every_block(servers):
    procs, _ = servers
    server = procs["roomy"]

    async def storm():
        bodies = [{"prompt": f"request {i} " * 4, "stream": i % 2 == 0, **LONG} for i in range(100)]
        return await asyncio.gather(*(_post_and_give_up(server.port, b, 0.5) for b in bodies))

    aborted = ("vllm:request_success_total", {"finished_reason": "abort"})
    before = metric_value(_metrics(server.url), "vllm:generation_tokens_total")
    aborted_before = metric_value(_metrics(server.url), *aborted)
    asyncio.run(storm())
    t0 = time.monotonic()
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "short", "max_tokens": 4, "ignore_eos": True},
        timeout=_bound(5.0),
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < _bound(5.0)
    wait_idle(server.url, timeout=30)
    generated = metric_value(_metrics(server.url), "vllm:generation_tokens_total") - before
    assert 0 < generated < 100 * LONG["max_tokens"] / 2  # they ran, and they stopped early
    # Every abandoned request is counted as aborted (the short one finished by length).
    assert metric_value(_metrics(server.url), *aborted) - aborted_before == 100


# ---- preemption ---------------------------------------------------------------------------------
def test_preemption_storm_matches_unpressured_greedy_outputs(servers):
    procs, _ = servers
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 16))] for _ in range(64)]

    async def run(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:

            async def one(p):
                body = {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "length"
                return choice["text"]

            return await asyncio.gather(*(one(p) for p in prompts))

    tight = procs["tight"]
    preemptions = "vllm:num_preemptions_total"
    assert metric_value(_metrics(tight.url), "pagedserve:kv_cache_total_blocks") == 16
    pressured = asyncio.run(run(tight.url))
    relaxed = asyncio.run(run(procs["roomy"].url))
    assert pressured == relaxed
    assert metric_value(_metrics(tight.url), preemptions) > 0
    wait_idle(tight.url)
    wait_idle(procs["roomy"].url)


# ---- overload -----------------------------------------------------------------------------------
def test_overload_gets_503_with_retry_after_then_recovers(servers):
    procs, _ = servers
    server = procs["overload"]  # one running slot, queue bound Q = 3

    async def scenario():
        body = {"prompt": "hold the line", "stream": True, **LONG}
        holders = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            deadline = time.monotonic() + 60
            # One at a time: arrivals faster than the engine admits them would each see the
            # queue as full already. Ends with one running + Q waiting.
            for held in range(1, 5):
                holders.append(asyncio.create_task(_post_and_give_up(server.port, body, 120)))
                while True:
                    text = (await client.get("/metrics")).text
                    running = metric_value(text, "vllm:num_requests_running")
                    if running + metric_value(text, "vllm:num_requests_waiting") == held:
                        break
                    assert time.monotonic() < deadline, text
                    await asyncio.sleep(0.05)
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            elapsed = time.monotonic() - t0
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return r, elapsed

    r, elapsed = asyncio.run(scenario())
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert elapsed < _bound(2.0)  # refused at once, not after queueing behind the holders
    wait_idle(server.url)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


# ---- health under faults ------------------------------------------------------------------------
async def _pending_pair(url: str):
    """A stream and a plain request, both running when the fault hits."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def stream():
            body = {"prompt": "stream me", "stream": True, **LONG}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
                health = (await client.get("/health")).status_code
                return r.status_code, _sse_events(lines), health

        async def plain():
            r = await client.post("/v1/completions", json={"prompt": "plain", **LONG})
            return r.status_code, r.json()

        return await asyncio.gather(stream(), plain())


def _assert_failed_cleanly(server: ServerProcess, result, exit_timeout: float = 60.0):
    (status, events, health_after), (plain_status, plain_body) = result
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] and error["type"]
    assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # it had been running
    assert health_after == 503
    assert plain_status == 503 and plain_body["error"]["type"] == "ServiceUnavailableError"
    assert server.proc.wait(exit_timeout) != 0  # an orchestrator restarts it


def test_engine_crash_fails_pending_requests_and_exits_nonzero(servers):
    procs, _ = servers
    server = procs["crash"]
    _assert_failed_cleanly(server, asyncio.run(_pending_pair(server.url)))
    assert "injected fault" in server.log()


def test_engine_stall_turns_health_503_and_fails_pending_requests(servers):
    procs, _ = servers
    server = procs["stall"]
    _assert_failed_cleanly(server, asyncio.run(_pending_pair(server.url)))
    assert "made no progress for 3 s" in server.log()


# ---- graceful shutdown --------------------------------------------------------------------------
def test_sigterm_lets_streams_finish_refuses_new_ones_and_exits_0(servers):
    procs, _ = servers
    server = procs["roomy"]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = asyncio.Event()

            async def stream(i: int):
                body = {"prompt": f"drain {i}", "stream": True, **LONG, "max_tokens": 200}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        started.set()
                        lines.append(line)
                    return _sse_events(lines)

            streams = [asyncio.create_task(stream(i)) for i in range(3)]
            await started.wait()
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as fresh:
                refused = await fresh.post("/v1/completions", json={"prompt": "late"})
            return await asyncio.gather(*streams), refused, t0

    results, refused, t0 = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.json()["error"]["message"]
    for events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
    assert time.monotonic() - t0 < 60


def test_sigterm_fails_streams_still_running_at_the_timeout_and_exits_0(servers):
    procs, _ = servers
    server = procs["overload"]  # --shutdown-timeout 2

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {"prompt": "too long to drain", "stream": True, **LONG}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                async for line in r.aiter_lines():
                    if not lines:
                        server.proc.send_signal(signal.SIGTERM)
                    lines.append(line)
                return _sse_events(lines)

    t0 = time.monotonic()
    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 30
