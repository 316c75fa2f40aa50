"""Fleet benchmark: 2 pagedserve replicas on loopback behind vllm-router (pip install
vllm-router), one run per routing policy on the same multi-tenant prefix workload:

    kv_aware     routes on the replicas' KV-cache events (--kv-events-config)
    cache_aware  the router's own prefix tree of what it sent where
    round_robin  neither

Workload: TENANTS system prompts, each shared by USERS users who add a short question; the
requests of all tenants are interleaved and sent CONCURRENCY at a time. Each replica's pool
holds only some tenants' prefixes (--num-gpu-blocks-override), so where a request lands
decides whether its prefix is a hit. Printed per policy, from one run: the fleet's prefix-cache
hit rate (replicas' vllm:prefix_cache_hits / queries over the run), TTFT p50/p90 and
throughput, and the ratios against round_robin.

    python bench/fleet.py [--model DIR] [--tenants 8] [--users 4] [--blocks 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import httpx

POLICIES = ("kv_aware", "cache_aware", "round_robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(i: int, args, events_port: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://*:{events_port + 1}"}
    cmd = [sys.executable, "-m", "server.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--block-size", str(args.block_size),
           "--num-gpu-blocks-override", str(args.blocks), "--kv-events-config", json.dumps(config),
           "--prefix-caching-hash-algo", args.prefix_caching_hash_algo]
    log = open(f"/tmp/fleet-replica-{i}.log", "w")  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def start_router(policy: str, replicas: list[str], events: list[int], block_size: int,
                 extra: tuple[str, ...] = ()):
    port = free_port()
    model = httpx.get(replicas[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
    cmd = [shutil.which("vllm-router") or "vllm-router", "--host", "127.0.0.1", "--port",
           str(port), "--policy", policy, "--worker-urls", *replicas]
    if policy == "kv_aware":  # the router refuses event sources under any other policy
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model, *extra]
    for url, ev in zip(replicas, events if policy == "kv_aware" else []):
        cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}"]
        cmd += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{ev + 1}"]
    log = open(f"/tmp/fleet-router-{policy}.log", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def wait_ready(url: str, path: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}{path} not ready in {timeout:g} s")


def workload(tenants: int, users: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud maple ember quartz orbit lantern".split()
    systems = [
        f"You are assistant #{t} for team {rng.randint(100, 999)}. "
        + " ".join(rng.choice(words) for _ in range(120))
        for t in range(tenants)
    ]
    prompts = [f"{systems[t]}\nUser {u}: question {rng.randint(0, 99)}?\nAnswer:"
               for u in range(users) for t in range(tenants)]
    return prompts


def cache_counters(replicas: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in replicas:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run(router: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient, prompt: str) -> int:
        async with sem:
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            start, first, tokens = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter()
                        tokens += 1
            ttfts.append((first or time.perf_counter()) - start)
            return tokens

    async with httpx.AsyncClient(base_url=router, timeout=600) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, p) for p in prompts))
        took = time.perf_counter() - start
    ttfts.sort()
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]  # noqa: E731
    return {"ttft_p50": pct(0.5), "ttft_p90": pct(0.9), "req_s": len(prompts) / took,
            "tok_s": sum(tokens) / took}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--blocks", type=int, default=96, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated, run in this order (the ratios need round_robin)")
    p.add_argument("--kv-aware-args", default="",
                   help="more vllm-router flags for kv_aware, e.g. "
                   "'--kv-aware-session-affinity-ttl-secs 60'")
    p.add_argument("--prefix-caching-hash-algo", default="builtin",
                   help="the replicas' block hashes: builtin or vLLM's sha256 / sha256_cbor")
    args = p.parse_args()
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    events = [free_port() for _ in range(2)]  # each replica also binds the next port (replay)
    started = [start_replica(i, args, ev) for i, ev in enumerate(events)]
    replicas = [url for _, url in started]
    results = {}
    try:
        for url in replicas:
            wait_ready(url, "/health")
        for policy in args.policies.split(","):
            seed = POLICIES.index(policy)
            # its own tenants per policy: no policy finds another's prefixes cached
            prompts = workload(args.tenants, args.users, seed)
            proc, router = start_router(policy, replicas, events, args.block_size,
                                        tuple(args.kv_aware_args.split()))
            try:
                wait_ready(router, "/health", 60)
                h0, q0 = cache_counters(replicas)
                load0 = os.getloadavg()[0]
                results[policy] = asyncio.run(run(router, prompts, args.concurrency,
                                                  args.max_tokens))
                h1, q1 = cache_counters(replicas)
                results[policy]["hit_rate"] = (h1 - h0) / max(q1 - q0, 1)
                # the machine's 1-minute load average before and after (shared machines)
                results[policy]["load"] = (load0, os.getloadavg()[0])
                print(policy, results[policy], flush=True)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(30)
    base = results.get("round_robin") or next(iter(results.values()))
    print(f"{'policy':12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>7} "
          f"{'p50 vs rr':>9} {'req/s vs rr':>11} {'load':>11}")
    for policy, r in results.items():
        print(f"{policy:12} {r['hit_rate']:8.3f} {r['ttft_p50']:9.3f} {r['ttft_p90']:9.3f} "
              f"{r['req_s']:7.2f} {r['ttft_p50'] / base['ttft_p50']:9.2f} "
              f"{r['req_s'] / base['req_s']:11.2f} {r['load'][0]:5.1f}-{r['load'][1]:<5.1f}")


if __name__ == "__main__":
    main()
