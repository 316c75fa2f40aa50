"""Memory and time of oneDNN's bf16 linear over many row counts, exact against padded (not a test).

    python bench/onednn_rows.py                   # 576 -> 1536 (SmolLM2's MLP), rows 33..512
    python bench/onednn_rows.py --in 2048 --out 8192 --max-rows 1024

oneDNN compiles and caches a kernel per row count it meets; pagedserve_kernels/cpu_linear.py pads
every oneDNN call to onednn_rows(rows). This runs each row count from --min-rows to --max-rows once
in random order, in a child process per mode (the caches are per process): "exact" calls oneDNN at
the row count itself, "padded" goes through PackedLinear. Reports glibc's memory in use after
malloc_trim every --report-every calls, the time of the first pass (compiling included) and of a
second pass over the same row counts (cached).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in", dest="in_features", type=int, default=576)
    p.add_argument("--out", dest="out_features", type=int, default=1536)
    p.add_argument("--min-rows", type=int, default=33)
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--report-every", type=int, default=120)
    p.add_argument("--mode", choices=["exact", "padded"], help="one mode, in this process")
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run(args)))
        return
    for mode in ("exact", "padded"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    import pagedserve_kernels.cpu_linear as cpu_linear

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(args.in_features, args.out_features, bias=False).bfloat16()
    packed = cpu_linear.PackedLinear(linear, None)  # no AMX kernel: oneDNN at every row count
    row_counts = list(range(args.min_rows, args.max_rows + 1))
    random.Random(0).shuffle(row_counts)
    xs = {m: torch.randn(m, args.in_features, dtype=torch.bfloat16) for m in row_counts}

    def call(m: int) -> None:
        if args.mode == "exact":
            cpu_linear.onednn_linear(xs[m], packed.large, None)
        else:
            packed(xs[m])

    curve, base = [], in_use_mib(libc)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i, m in enumerate(row_counts, 1):
            call(m)
            if i % args.report_every == 0 or i == len(row_counts):
                curve.append({"row_counts": i, "in_use_mib": round(in_use_mib(libc) - base, 1)})
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for m in row_counts:
            call(m)
        second_s = time.perf_counter() - t0
    return {
        "mode": args.mode,
        "shape": [args.in_features, args.out_features],
        "growth": curve,
        "first_pass_s": round(first_s, 2),
        "second_pass_s": round(second_s, 2),
        "distinct_onednn_row_counts": len({cpu_linear.onednn_rows(m) for m in row_counts})
        if args.mode == "padded"
        else len(row_counts),
    }


def in_use_mib(libc: ctypes.CDLL) -> float:
    """glibc's bytes in use (arenas and direct mappings) after malloc_trim, in MiB."""
    sys.path.insert(0, str(ROOT / "bench"))
    from soak import MallInfo2

    gc.collect()
    libc.malloc_trim(0)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


if __name__ == "__main__":
    main()
