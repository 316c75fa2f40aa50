"""How fast this machine is right now: bf16 matmul TFLOP/s and streaming-read GB/s.

On a shared host both swing a lot from minute to minute (in our runs the AMX matmul rate moved
about 4x between neighbouring minutes). peers.sh runs this before every round, so a round's
throughput can be read against the state the machine was in.

    python bench/machine_probe.py [--out probe.json] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def best_time(fn, seconds: float) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernel on the first call
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def probe(seconds: float = 1.0) -> dict:
    n = 1024
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    matmul_s = best_time(lambda: torch.matmul(a, b), seconds / 2)
    x = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB: far beyond any cache
    read_s = best_time(lambda: x.sum(), seconds / 2)
    return {
        "bf16_matmul_tflops": round(2 * n**3 / matmul_s / 1e12, 3),
        "read_gb_per_s": round(x.numel() * x.element_size() / read_s / 1e9, 2),
        "threads": torch.get_num_threads(),
        "time": time.strftime("%H:%M:%S", time.gmtime()),
    }


def describe(p: dict) -> str:
    return (
        f"bf16 matmul {p['bf16_matmul_tflops']:.2f} TFLOP/s, "
        f"read {p['read_gb_per_s']:.1f} GB/s ({p['threads']} threads, {p['time']} UTC)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the numbers here as JSON")
    ap.add_argument("--seconds", type=float, default=1.0, help="time spent measuring")
    args = ap.parse_args()
    result = probe(args.seconds)
    print(f"machine: {describe(result)}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
