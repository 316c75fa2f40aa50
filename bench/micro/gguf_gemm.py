"""Many-row GGUF linears: gguf_gemm (pagedserve_kernels/csrc/gguf_gemm.cpp) against the other paths,
one run.

    OMP_NUM_THREADS=1 python bench/micro/gguf_gemm.py --threads 1
    OMP_NUM_THREADS=2 python bench/micro/gguf_gemm.py --threads 2

Per linear shape of the default model (SmolLM2-135M: q, k/v, o, gate_up, down, lm_head), GGUF
type (random valid blocks) and row count M, the time per call of: bf16 weights on the AMX linear
(pagedserve_kernels/cpu_linear.py PackedLinear), the VNNI integer kernel (gguf_linear), dequantize +
matmul (gguf_dequantize, then F.linear), and gguf_gemm; then the old dispatch (VNNI up to
VNNI_MAX_ROWS rows, dequantize + matmul above) and the new one (engine/layers/quantization/gguf.py
GEMM_MIN_ROWS) relative to bf16. The arms run interleaved, round after round, and each keeps its
best round. With one thread the clock is the process's CPU time (what the call costs, whatever else
the machine runs); with more it is the wall clock (CPU time would count the workers' spinning).
The K types need K % 256 == 0: of these shapes only down (576 x 1536) takes them.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from harness import CLOCKS, ab_rounds

from engine.layers.quantization import gguf as gguf_quant
from engine.layers.quantization.gguf import GGUF_TYPES, VNNI_MAX_ROWS, pack_parts
from pagedserve_kernels.cpu_linear import PackedLinear
from pagedserve_kernels.cpu_ops import load_cpu_ops

SHAPES = {  # (N, K) as the default model serves them
    "q": (576, 576), "k/v": (192, 576), "o": (576, 576), "gate_up": (3072, 576),
    "down": (576, 1536), "lm_head": (49152, 576),
}


def random_blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """Random valid GGUF blocks (sane fp16 scales and mins), as tests/test_gguf_quant.py's."""
    rng = np.random.default_rng(0)
    t = GGUF_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // t.block, t.nbytes), dtype=np.uint8)
    offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2)}
    half = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for off in offsets.get(qtype, (0,)):
        raw[..., off : off + 2] = half
    return raw.reshape(n, -1)


def clock(threads: int):
    return CLOCKS["cpu" if threads == 1 else "wall"]


def linears(ops, shapes: list[str], types: list[str], rows: list[int], rounds: int,
            threads: int) -> None:
    now = clock(threads)
    which = "process CPU time" if threads == 1 else "wall clock"
    print(f"GGUF linears, {threads} thread(s), {which}, us per call (best of {rounds} rounds); "
          f"old = VNNI up to {VNNI_MAX_ROWS} rows, dequantize + matmul above; "
          f"new = gguf_gemm from {gguf_quant.GEMM_MIN_ROWS} rows, VNNI below")
    print(f"{'shape':>8} {'N x K':>11} {'type':>5} {'M':>4} {'bf16':>9} {'vnni':>9} "
          f"{'deq+mm':>9} {'gemm':>9} {'old/bf16':>8} {'new/bf16':>8} {'old/new':>8}")
    for name in shapes:
        n, k = SHAPES[name]
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        bf16 = PackedLinear(lin, ops)
        for qtype in types:
            if k % GGUF_TYPES[qtype].block:
                continue
            part = pack_parts([(qtype, random_blocks(qtype, n, k))])[0]
            args = (part.qs, part.qh, part.scales, part.mins, part.bits, part.zero)
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16)
                w = torch.empty(n, k, dtype=torch.bfloat16)

                def deq_mm(x=x, out=out, w=w, args=args):
                    ops.gguf_dequantize(w, *args)
                    out.copy_(F.linear(x, w))

                arms = {
                    "bf16": lambda x=x, bf16=bf16: bf16(x),
                    "vnni": lambda x=x, out=out, a=args: ops.gguf_linear(out, x, *a, None),
                    "deq+mm": deq_mm,
                    "gemm": lambda x=x, out=out, a=args: ops.gguf_gemm(out, x, *a, None),
                }
                t = ab_rounds(arms, rounds, clock=now, budget_s=0.02)
                old = t["vnni"] if m <= VNNI_MAX_ROWS else t["deq+mm"]
                new = t["gemm"] if m >= gguf_quant.GEMM_MIN_ROWS else t["vnni"]
                print(f"{name:>8} {f'{n}x{k}':>11} {qtype:>5} {m:>4} {1e6 * t['bf16']:9.1f} "
                      f"{1e6 * t['vnni']:9.1f} {1e6 * t['deq+mm']:9.1f} {1e6 * t['gemm']:9.1f} "
                      f"{old / t['bf16']:8.2f} {new / t['bf16']:8.2f} {old / new:8.2f}",
                      flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    p.add_argument("--rows", default="8,32,64,256")
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None or not gguf_quant.gemm_available(ops):
        raise SystemExit("gguf_gemm needs the CPU kernels and AMX-BF16")
    rows = [int(r) for r in args.rows.split(",")]
    linears(ops, args.shapes.split(","), args.types.split(","), rows, args.rounds, args.threads)


if __name__ == "__main__":
    main()
