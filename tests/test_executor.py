"""The executor's failure semantics through the real server on loopback
(engine/executor/executor.py).

A model worker that dies (SIGKILL, SIGSEGV) or stops answering (SIGSTOP) makes the engine dead:
the stream in flight gets an error event then `data: [DONE]`, a plain request a 5xx error
object, /health 503, the server exits non-zero, and no worker process is left. SIGTERM drains and
leaves no process; a start-up that fails in one rank leaves none either. Servers start together
in one module fixture so their slow imports overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess, build_tiny_model_dir

from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.executor.executor import WireEncoder
from engine.sampling_params import SamplingParams

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _bound(seconds: float) -> float:
    """A wall-clock bound, stretched by oversubscription of this machine."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def descendants(pid: int) -> list[int]:
    """Every live process below pid (from /proc: no dependency)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def worker_pids(pid: int) -> list[int]:
    """The model workers under pid (multiprocessing spawn children, not its resource tracker)."""
    pids = []
    for child in descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmd:
            pids.append(child)
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + _bound(timeout)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "worker processes outlived the server"


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory) -> Path:
    # vocab 260: the byte tokenizer's 259 ids padded to split over two ranks
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-tp"), vocab_size=260)


@pytest.fixture(scope="module")
def servers(tp_model_dir):
    def spawn(*args: str) -> ServerProcess:
        return ServerProcess(str(tp_model_dir), "--dtype", "float32", *args)

    procs = {
        "segv": spawn("--distributed-executor-backend", "mp"),
        "kill": spawn("--tensor-parallel-size", "2"),
        "stop": spawn("--tensor-parallel-size", "2", "--engine-stall-timeout", "3"),
        "term": spawn("--tensor-parallel-size", "2", "--shutdown-timeout", "60"),
        "idle": spawn("--tensor-parallel-size", "2"),
    }
    try:
        for s in procs.values():
            s.wait_ready()
        yield procs
    finally:
        for s in procs.values():
            pids = worker_pids(s.proc.pid)
            s.stop()
            for p in pids:  # a failed test must not leave them running either
                if alive(p):
                    os.kill(p, signal.SIGKILL)


def _events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


async def _fault_mid_stream(server: ServerProcess, pid: int, sig: int):
    """A stream and a plain request in flight when `sig` reaches worker `pid`."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        started = asyncio.Event()

        async def stream():
            body = {"prompt": "fault me", "stream": True, **LONG}
            lines = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not started.is_set():
                        started.set()
                        os.kill(pid, sig)
                    lines.append(line)
            return r.status_code, _events(lines)

        async def plain():
            await started.wait()
            r = await client.post("/v1/completions", json={"prompt": "plain", **LONG})
            return r.status_code, r.json()

        (status, events), (plain_status, plain_body) = await asyncio.gather(stream(), plain())
        health = (await client.get("/health")).status_code
    return status, events, plain_status, plain_body, health


def _assert_dead_cleanly(server: ServerProcess, result, pids: list[int], bound: float = 60.0):
    status, events, plain_status, plain_body, health = result
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] and error["type"]
    assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # it had streamed
    assert plain_status >= 500 and plain_body["error"]["message"]
    assert health == 503
    assert server.proc.wait(_bound(bound)) == 1  # the dead-engine status an orchestrator reads
    assert_gone(pids)
    return server.log_path.read_text()


def test_mp_at_one_rank_survives_a_worker_segfault_and_reports_it(servers):
    server = servers["segv"]
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 1  # the model runs outside the HTTP process
    log = _assert_dead_cleanly(
        server, asyncio.run(_fault_mid_stream(server, pids[0], signal.SIGSEGV)), pids
    )
    assert "worker rank 0 died (killed by SIGSEGV)" in log
    assert "Fatal Python error: Segmentation fault" in log  # the worker's faulthandler stack


def test_killed_rank_ends_streams_with_an_error_and_the_server_exits_1(servers):
    server = servers["kill"]
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2
    log = _assert_dead_cleanly(
        server, asyncio.run(_fault_mid_stream(server, pids[1], signal.SIGKILL)), pids
    )
    assert "died (killed by SIGKILL)" in log or "failed" in log


def test_a_worker_killed_while_idle_turns_health_503_within_5s_and_exits_1(servers):
    """No request runs, so no step trips on the death: the executor's sentinel watcher must."""
    server = servers["idle"]
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    os.kill(pids[1], signal.SIGKILL)
    killed, status = time.monotonic(), 200
    while status == 200 and time.monotonic() - killed < 5.0:
        time.sleep(0.05)
        try:
            status = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.TransportError:
            break  # already gone: exited (the status is checked below)
    assert status != 200, "/health still 200 5 s after a worker died"
    assert server.proc.wait(_bound(30)) == 1
    assert_gone(pids)
    log = server.log_path.read_text()
    assert "worker rank 1 died (killed by SIGKILL)" in log, log[-3000:]


def test_rank_that_stops_answering_is_dead_within_the_stall_bound(servers):
    server = servers["stop"]  # --engine-stall-timeout 3
    pids = worker_pids(server.proc.pid)
    t0 = time.monotonic()
    log = _assert_dead_cleanly(
        server, asyncio.run(_fault_mid_stream(server, pids[1], signal.SIGSTOP)), pids, bound=30
    )
    assert time.monotonic() - t0 < _bound(30)
    assert "made no progress for 3 s" in log


def test_sigterm_drains_and_leaves_no_worker(servers):
    server = servers["term"]
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {"prompt": "drain", "stream": True, **LONG, "max_tokens": 40}
            lines = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not lines:
                        server.proc.send_signal(signal.SIGTERM)
                    lines.append(line)
            return _events(lines)

    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(_bound(60)) == 0
    assert_gone(pids)


def test_start_up_failing_in_one_rank_exits_1_and_leaves_no_worker(tp_model_dir, tmp_path):
    # rank 1 dies while loading: rank 0 waits at the rendezvous, so both must be watched
    server = ServerProcess(
        str(tp_model_dir),
        *("--dtype", "float32", "--tensor-parallel-size", "2"),
        env={"PAGEDSERVE_WORKER_FAULT": "segv_at_load", "PAGEDSERVE_WORKER_FAULT_RANK": "1"},
    )
    seen: list[int] = []
    deadline = time.monotonic() + _bound(120)
    while server.proc.poll() is None and time.monotonic() < deadline:
        seen += worker_pids(server.proc.pid)
        time.sleep(0.2)
    code = server.stop()
    assert code == 1
    assert "worker rank 1 died while loading (killed by SIGSEGV)" in server.log_path.read_text()
    assert seen  # workers had started
    assert_gone(sorted(set(seen)))


def test_sizes_that_do_not_divide_are_named_before_any_worker_starts(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "odd", num_attention_heads=4, intermediate_size=129)
    server = ServerProcess(str(model_dir), "--dtype", "float32", "--tensor-parallel-size", "2")
    assert server.proc.wait(_bound(120)) == 1
    server.stop()
    log = server.log_path.read_text()
    assert "tensor_parallel_size 2 does not divide vocab_size (259), intermediate_size (129)" in log
    assert "executor: mp" not in log  # refused before any worker started


def test_wire_sends_the_prompt_once_then_only_new_tokens():
    import pickle

    enc = WireEncoder()
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2)

    def step(**kw) -> tuple:
        out = SchedulerOutput(requests=[req], num_scheduled_tokens=[1], num_computed_tokens=[0])
        for k, v in kw.items():
            setattr(out, k, v)
        wire, first, ids, appended = pickle.loads(enc.encode(out))[1]
        assert wire.requests == [] and ids == ["r"]
        return [(d.new_token_ids, d.params) for d in first], appended

    assert step() == ([([5, 6, 7], req.sampling_params)], [[]])  # first sight: prompt, params
    req.all_token_ids.append(9)
    assert step() == ([], [[9]])  # then only what the workers have not seen
    assert step() == ([], [[]])
    enc.encode(SchedulerOutput(finished_req_ids=["r"]))
    assert "r" not in enc.num_sent  # finished: forgotten on both sides
