"""bench/serve.py's client against a loopback server that drops a kept-alive connection.

llama-server closes a kept-alive connection now and then without answering the next request on
it; bench/serve.py sends such a request once more on a new connection (as the OpenAI SDK
retries a connection error) and counts it, instead of counting a failed request.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx

_SPEC = importlib.util.spec_from_file_location(
    "bench_serve", Path(__file__).resolve().parents[1] / "bench" / "serve.py"
)
bench_serve = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_serve"] = bench_serve  # its dataclasses look their module up
_SPEC.loader.exec_module(bench_serve)


def _sse_response(tokens: int) -> bytes:
    events = [{"choices": [{"text": f"t{i}"}]} for i in range(tokens)]
    events.append({"choices": [], "usage": {"completion_tokens": tokens}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


async def _run(drop: set[int], tokens: int = 3):
    """Serves every request on a kept-alive connection, except that the requests whose arrival
    index (0-based) is in `drop` are met by closing their connection without a response. Sends
    three requests one after the other on one client; returns their results and the connections
    the server accepted."""
    state = {"connections": 0, "arrived": 0}

    async def handle(reader, writer):
        state["connections"] += 1
        try:
            while True:
                await _read_request(reader)
                state["arrived"] += 1
                if state["arrived"] - 1 in drop:
                    break  # the kept-alive connection goes away unanswered
                writer.write(_sse_response(tokens))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/completions"
    req = bench_serve.BenchRequest(prompt_token_ids=[1, 2, 3], max_tokens=tokens)
    async with server, httpx.AsyncClient(timeout=10) as client:
        results = [await bench_serve.send_request(client, url, "m", req) for _ in range(3)]
    return results, state["connections"]


def test_a_request_the_server_dropped_unanswered_is_sent_once_more():
    # the second request reuses the first one's connection, which the server closes unanswered
    results, connections = asyncio.run(_run(drop={1}))
    assert [r.ok for r in results] == [True, True, True]
    assert [r.retried for r in results] == [False, True, False]
    assert [r.num_output_tokens for r in results] == [3, 3, 3]
    assert connections == 2  # the retry opened a new connection, the third request reused it


def test_a_second_drop_is_a_failure_not_another_retry():
    results, _ = asyncio.run(_run(drop={1, 2}))
    assert results[0].ok and not results[0].retried
    assert not results[1].ok and "RemoteProtocolError" in results[1].error
    assert results[2].ok and not results[2].retried


def test_the_summary_counts_the_requests_sent_twice():
    results, _ = asyncio.run(_run(drop={1}))
    wl = bench_serve.Workload("std", [bench_serve.BenchRequest([1, 2, 3], 3)] * 3, 1, float("inf"))
    summary = bench_serve.summarize("x", wl, results, 1.0)
    assert summary["num_retried"] == 1 and summary["num_completed"] == 3
