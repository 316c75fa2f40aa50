"""Soak: steady mixed load with random client aborts against a live server (not a CI test).

    python bench/soak.py                      # tiny random-weight model, 5 minutes
    python bench/soak.py --model DIR --duration 600 --concurrency 16
    python bench/soak.py --url http://127.0.0.1:8000   # an already running server

Reports requests served, failures (target 0), p50/p99 latency, the server's RSS and the KV
free blocks at start and end (target: no growth, every block free once idle).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    args = parse_args()
    server, url = start_server(args) if args.url is None else (None, args.url.rstrip("/"))
    try:
        report = asyncio.run(soak(url, args, server.pid if server else args.pid))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    print(json.dumps(report, indent=2))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server; omitted: start one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--model", help="model for the started server; default: tiny random Llama")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("--abort-fraction", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    model = args.model or str(build_tiny_model())
    port = load_test_builders().free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", model, "--port", str(port)]
    cmd += ["--dtype", "float32", "--log-level", "warning"]
    log = open(Path(tempfile.gettempdir()) / f"soak-server-{port}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}; see {log.name}")
        time.sleep(0.5)
    raise SystemExit("server not ready in 600 s")


def build_tiny_model() -> Path:
    return load_test_builders().build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="soak-tiny-")))


def load_test_builders() -> ModuleType:
    """tests/conftest.py, loaded by path: the test builders are not in the installed package."""
    spec = importlib.util.spec_from_file_location("soak_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- measurements -------------------------------------------------------------------------------
def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def kv_blocks(client: httpx.AsyncClient, idle_timeout: float = 60.0) -> dict:
    """Free and total KV blocks once nothing runs or waits (or after idle_timeout)."""
    deadline = time.monotonic() + idle_timeout
    while True:
        g = gauges((await client.get("/metrics")).text)
        idle = g.get("num_requests_running", 0) == g.get("num_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return {
                "idle": idle,
                "free": g.get("kv_cache_free_blocks"),
                "total": g.get("kv_cache_total_blocks"),
            }
        await asyncio.sleep(0.5)


def gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("pagedserve:") and "{" in line:
            name = line.split("{", 1)[0].removeprefix("pagedserve:")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


# ---- load ---------------------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.served = self.aborted = 0
        self.failures: list[str] = []


async def soak(url: str, args: argparse.Namespace, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await one_request(client, rng, args, Tally())  # warm-up
        start = {"rss_mib": rss_mib(pid), "kv": await kv_blocks(client)}
        tally, t_end = Tally(), time.monotonic() + args.duration
        workers = [
            worker(client, url, random.Random(rng.random()), args, tally, t_end)
            for _ in range(args.concurrency)
        ]
        await asyncio.gather(*workers)
        end = {"rss_mib": rss_mib(pid), "kv": await kv_blocks(client)}
    lat = sorted(tally.latencies)
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None
    return {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "requests_served": tally.served,
        "requests_aborted_by_client": tally.aborted,
        "failures": len(tally.failures),
        "failure_samples": tally.failures[:5],
        "latency_p50_s": pct(0.50),
        "latency_p99_s": pct(0.99),
        "start": start,
        "end": end,
    }


async def worker(client, url, rng, args, tally: Tally, t_end: float) -> None:
    while time.monotonic() < t_end:
        if rng.random() < args.abort_fraction:
            await abandoned_request(url, rng, args)
            tally.aborted += 1
        else:
            await one_request(client, rng, args, tally)


def random_body(rng: random.Random, args: argparse.Namespace) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "paged", "cache", "block", "token"]
    return {
        "prompt": " ".join(rng.choices(words, k=rng.randint(2, 40))),
        "max_tokens": rng.randint(1, args.max_tokens),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "ignore_eos": rng.random() < 0.5,
        "stream": rng.random() < 0.5,
    }


async def one_request(client, rng, args, tally: Tally) -> None:
    body = random_body(rng, args)
    t0 = time.monotonic()
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
            ok = ok and not any('"error"' in line for line in lines)
            detail = lines[-2:] if lines else r.status_code
        else:
            r = await client.post("/v1/completions", json=body)
            ok, detail = r.status_code == 200, r.text[:200]
    except httpx.HTTPError as e:
        ok, detail = False, repr(e)
    if ok:
        tally.served += 1
        tally.latencies.append(time.monotonic() - t0)
    else:
        tally.failures.append(f"{body}: {detail}")


async def abandoned_request(url: str, rng: random.Random, args: argparse.Namespace) -> None:
    """A raw request whose client hangs up after a random short wait (a real TCP close)."""
    body = json.dumps({**random_body(rng, args), "max_tokens": args.max_tokens * 4}).encode()
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        async with asyncio.timeout(rng.uniform(0.05, 1.0)):
            while await reader.read(4096):
                pass
    except TimeoutError:
        pass
    finally:
        writer.close()


if __name__ == "__main__":
    main()
