"""Memory soak: mixed load with client aborts and KV preemption against a server (not a test).

    python bench/soak.py                      # tiny random-weight model, 30 minutes
    python bench/soak.py --minutes 5 --concurrency 16 --model DIR
    python bench/soak.py --no-tracemalloc --trim-every-sample   # the memory the server holds
    python bench/soak.py --url http://127.0.0.1:8000 --pid PID   # a running server (no heap)

The server it starts gets a KV pool too small for its load (--num-gpu-blocks-override), so
requests are preempted and recomputed throughout, and runs under tracemalloc: every
--sample-every seconds the soak records the server's RSS and a heap snapshot (SIGUSR1 makes the
server dump one); once idle after the load, SIGUSR2 makes it malloc_trim, and the RSS after
that tells memory the allocator kept from memory still in use, with glibc's own counts (in use,
free in its arenas, mapped directly). Reports requests served, failures (target 0),
preemptions, p50/p99 latency, the RSS curve, the Python heap's biggest growers between the
first and the last snapshot, and the KV free blocks at start and end (target: every block free
once idle).

tracemalloc's own bookkeeping (a trace per live block, and the snapshots) is native memory in
the server's RSS that its heap totals leave out, and it grows under load: the RSS curve of the
server as deployed is the one measured with --no-tracemalloc (bench/results/HISTORY.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if sys.argv[1:2] == ["_traced_serve"]:  # the started server: tracemalloc, then serve
        traced_serve(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
        return
    args = parse_args()
    heap_dir = Path(tempfile.mkdtemp(prefix="soak-heap-")) if args.url is None else None
    server, url = start_server(args, heap_dir) if heap_dir else (None, args.url.rstrip("/"))
    try:
        report = asyncio.run(soak(url, args, server.pid if server else args.pid, heap_dir))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    print(json.dumps(report, indent=2))


def traced_serve(heap_dir: Path, frames: int, serve_args: list[str]) -> None:
    """pagedserve serve, under tracemalloc unless frames is 0; each SIGUSR1 dumps
    heap_dir/<n>.snap, SIGUSR2 has glibc hand its free memory back to the kernel (malloc_trim),
    to tell retained from live, and writes glibc's counts after it to heap_dir/malloc.json."""
    if frames > 0:
        tracemalloc.start(frames)
    count = 0

    def dump(_sig, _frame) -> None:
        nonlocal count
        tracemalloc.take_snapshot().dump(str(heap_dir / f"{count:04d}.snap"))
        count += 1

    def trim(_sig, _frame) -> None:
        libc.malloc_trim(0)
        (heap_dir / "malloc.json").write_text(json.dumps(malloc_counts(libc)))

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    signal.signal(signal.SIGUSR1, dump)
    signal.signal(signal.SIGUSR2, trim)
    from server.cli import main as serve_main

    serve_main(["serve", *serve_args])


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc 2.33+): the main and thread arenas' counts, in bytes."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]


def malloc_counts(libc: ctypes.CDLL) -> dict[str, float]:
    """MiB that glibc's malloc hands out (in use), keeps free in its arenas, and maps directly
    (blocks of 128 KiB and up): in-use growth is memory held, free growth is fragmentation."""
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    mib = lambda n: round(n / 2**20, 2)
    return {
        "malloc_in_use_mib": mib(info.uordblks),
        "malloc_free_mib": mib(info.fordblks),
        "malloc_mmap_mib": mib(info.hblkhd),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server; omitted: start one")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--model", help="model for the started server; default: tiny random Llama")
    p.add_argument("--minutes", type=float, default=30.0, help="minutes of load")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=48,
        help="KV blocks of the started server: fewer than the load needs, so it preempts",
    )
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--trace-frames", type=int, default=1, help="tracemalloc frames per block")
    p.add_argument(
        "--no-tracemalloc",
        action="store_true",
        help="serve without tracemalloc (no heap growers): its own memory stays out of the RSS",
    )
    p.add_argument(
        "--trim-every-sample",
        action="store_true",
        help="also record RSS after malloc_trim at every sample (the memory in use over time)",
    )
    p.add_argument("--top", type=int, default=15, help="heap growers to report")
    p.add_argument("--abort-fraction", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_server(args: argparse.Namespace, heap_dir: Path) -> tuple[subprocess.Popen, str]:
    model = args.model or str(build_tiny_model())
    port = load_test_builders().free_port()
    frames = 0 if args.no_tracemalloc else args.trace_frames
    cmd = [sys.executable, __file__, "_traced_serve", str(heap_dir), str(frames)]
    cmd += [model, "--port", str(port), "--dtype", "float32", "--log-level", "warning"]
    cmd += ["--num-gpu-blocks-override", str(args.num_blocks)]
    log = open(Path(tempfile.gettempdir()) / f"soak-server-{port}.log", "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
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
        if line.startswith(("pagedserve:", "vllm:")) and "{" in line:
            name = line.split("{", 1)[0].split(":", 1)[1]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Sampler:
    """RSS and (for a started server) a heap snapshot every `every` seconds of load; with trim,
    the RSS and glibc's counts after malloc_trim too. snapshots False: the server runs without
    tracemalloc."""

    def __init__(
        self, pid: int | None, heap_dir: Path | None, every: float, trim: bool, snapshots: bool
    ) -> None:
        self.pid, self.heap_dir, self.every, self.trim = pid, heap_dir, every, trim
        self.snapshots = snapshots
        self.t0 = time.monotonic()
        self.curve: list[dict] = []
        self.num_snapshots = 0

    async def sample(self, tally: Tally) -> None:
        point = {"t_s": round(time.monotonic() - self.t0), "rss_mib": rss_mib(self.pid)}
        point |= {"served": tally.served, "aborted": tally.aborted}
        self.curve.append(point)
        if self.heap_dir is None or self.pid is None:
            return
        if self.trim:  # RSS once glibc has returned its free pages: the memory in use
            point |= await trimmed(self.pid, self.heap_dir)
        if self.snapshots:
            os.kill(self.pid, signal.SIGUSR1)
            await self._wait_snapshot(self.num_snapshots)
            self.num_snapshots += 1

    async def _wait_snapshot(self, n: int, timeout: float = 120.0) -> None:
        path, deadline = self.heap_dir / f"{n:04d}.snap", time.monotonic() + timeout
        last_size = -1
        while time.monotonic() < deadline:  # dump() writes in place: wait until the size settles
            size = path.stat().st_size if path.exists() else -1
            if size > 0 and size == last_size:
                return
            last_size = size
            await asyncio.sleep(0.5)

    async def run(self, tally: Tally, t_end: float) -> None:
        while time.monotonic() + self.every < t_end:
            await asyncio.sleep(self.every)
            await self.sample(tally)

    def growers(self, top: int) -> list[dict]:
        """The heap's biggest growers from the first snapshot (after warm-up) to the last."""
        if self.heap_dir is None or self.num_snapshots < 2:
            return []
        first = tracemalloc.Snapshot.load(str(self.heap_dir / "0000.snap"))
        last_path = self.heap_dir / f"{self.num_snapshots - 1:04d}.snap"
        last = tracemalloc.Snapshot.load(str(last_path))
        heap = {"first_mib": _mib(first), "last_mib": _mib(last)}
        stats = last.compare_to(first, "lineno")[:top]
        rows = [
            {
                "where": str(s.traceback[0]),
                "size_diff_kib": round(s.size_diff / 1024, 1),
                "count_diff": s.count_diff,
                "size_kib": round(s.size / 1024, 1),
            }
            for s in stats
        ]
        return [heap, *rows]


async def trimmed(pid: int, heap_dir: Path, timeout: float = 30.0) -> dict:
    """Has the server malloc_trim (SIGUSR2), then its RSS and glibc's counts after it."""
    counts = heap_dir / "malloc.json"
    counts.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while not counts.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.2)  # the handler writes the file in one call: let it finish
    point = {"rss_mib_after_malloc_trim": rss_mib(pid)}
    return point | (json.loads(counts.read_text() or "{}") if counts.exists() else {})


def _mib(snapshot: tracemalloc.Snapshot) -> float:
    return round(sum(s.size for s in snapshot.statistics("filename")) / 2**20, 2)


# ---- load ---------------------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.served = self.aborted = 0
        self.failures: list[str] = []


async def soak(url: str, args: argparse.Namespace, pid: int | None, heap_dir) -> dict:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        warm = Tally()
        for _ in range(4):  # warm-up: first-use allocations stay out of the growth
            await one_request(client, rng, args, warm)
        start = {"rss_mib": rss_mib(pid), "kv": await kv_blocks(client)}
        preempted_before = gauges((await client.get("/metrics")).text).get("num_preemptions_total")
        tally, t_end = Tally(), time.monotonic() + args.minutes * 60
        sampler = Sampler(
            pid, heap_dir, args.sample_every, args.trim_every_sample, not args.no_tracemalloc
        )
        await sampler.sample(tally)
        workers = [
            worker(client, url, random.Random(rng.random()), args, tally, t_end)
            for _ in range(args.concurrency)
        ]
        await asyncio.gather(sampler.run(tally, t_end), *workers)
        end = {"rss_mib": rss_mib(pid), "kv": await kv_blocks(client)}
        await sampler.sample(tally)  # idle, after the load
        if heap_dir is not None and pid is not None:  # what of the growth is free but retained
            end |= await trimmed(pid, heap_dir)
        preempted = gauges((await client.get("/metrics")).text).get("num_preemptions_total")
    lat = sorted(tally.latencies)
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests_served": tally.served,
        "requests_aborted_by_client": tally.aborted,
        "failures": len(tally.failures),
        "failure_samples": tally.failures[:5],
        "preemptions": (preempted or 0) - (preempted_before or 0),
        "latency_p50_s": pct(0.50),
        "latency_p99_s": pct(0.99),
        "start": start,
        "end": end,
        "rss_curve": sampler.curve,
        "heap_growers": sampler.growers(args.top),
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
