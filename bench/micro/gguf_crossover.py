"""Where packed GGUF weights stop beating dense bf16 ones: the per-call row crossover of
`--gguf-weights auto` (engine/layers/quantization/gguf.py PACKED_MAX_ROWS), one run.

    OMP_NUM_THREADS=1 python bench/micro/gguf_crossover.py            # process CPU time
    OMP_NUM_THREADS=2 python bench/micro/gguf_crossover.py --threads 2  # wall clock

Per linear shape (the default model, SmolLM2-135M, and a Llama-3.2-1B-shaped model), GGUF type
(random valid blocks) and row count M, the time per call of the two weights a GGUF linear can
run on: `dense`, the bf16 weight on the packed linear (pagedserve_kernels/cpu_linear.py
PackedLinear: dense_linear up to 32 rows, oneDNN above) and `packed`, the GGUF blocks as
GGUFWeights runs them (the VNNI integer kernel, gguf_gemm from GEMM_MIN_ROWS rows on AMX, a
whole-weight dequantize + matmul above VNNI_MAX_ROWS without it), and packed / dense. The arms run
interleaved, round after round, each keeping its best round (bench/micro/harness.py). The last
line per model sums the shapes of one decoder layer (as many calls as one layer makes) and
names the largest M where the packed layer is still at most as slow as the dense one.
"""

from __future__ import annotations

import argparse

import torch
from gguf_gemm import random_blocks
from harness import CLOCKS, ab_rounds

from engine.layers.quantization.gguf import GGUF_TYPES, GGUFWeights, pack_parts
from pagedserve_kernels.cpu_linear import PackedLinear
from pagedserve_kernels.cpu_ops import load_cpu_ops

MODELS = {  # name -> (layers timed, ((shape, N, K), ...) of one decoder layer)
    "135M": (30, (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                  ("down", 576, 1536))),
    "1B": (4, (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
               ("down", 2048, 8192))),
}
HEADS = {"135M": ("lm_head", 49152, 576)}  # the 1B lm_head (128256 x 2048) is left out: slow


def stack(ops, shapes, layers: int, qtype: str):
    """layers x shapes distinct weights (more bytes than the L3 holds, as a served model's):
    (dense modules, packed modules)."""
    dense, packed = [], []
    for _ in range(layers):
        for _, n, k in shapes:
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            dense.append(PackedLinear(lin, ops))
            packed.append(GGUFWeights(pack_parts([(qtype, random_blocks(qtype, n, k))]), None,
                                      ops))
    return dense, packed


def arms_for(dense, packed, m: int) -> dict:
    xs = {mod.in_features: torch.randn(m, mod.in_features, dtype=torch.bfloat16)
          for mod in packed}

    def run_all(mods):
        for mod in mods:
            mod(xs[mod.in_features])

    outs = [torch.empty(m, mod.out_features, dtype=torch.bfloat16) for mod in packed]

    def vnni_all():  # the integer kernel at every row count (no whole-weight dequantize)
        for mod, out in zip(packed, outs):
            p = mod.parts[0]
            mod.ops.gguf_linear(out, xs[mod.in_features], p.qs, p.qh, p.scales, p.mins, p.bits,
                                p.zero, None)

    return {"dense": lambda: run_all(dense), "packed": lambda: run_all(packed), "vnni": vnni_all}


def run(ops, models: list[str], types: dict[str, str], rows: list[int], rounds: int,
        threads: int) -> None:
    now = CLOCKS["cpu" if threads == 1 else "wall"]
    print(f"{threads} thread(s), {'process CPU time' if threads == 1 else 'wall clock'}, "
          f"ms per call of every linear in the stack, best of {rounds} rounds")
    print(f"{'model':>5} {'what':>16} {'type':>5} {'M':>4} {'dense':>9} {'packed':>9} "
          f"{'vnni':>9} {'packed/dense':>12} {'vnni/dense':>10}")
    for model in models:
        layers, shapes = MODELS[model]
        cases = [(f"{layers} layers", stack(ops, shapes, layers, types["layer"]),
                  types["layer"])]
        if model in HEADS:
            head = stack(ops, [HEADS[model]], 1, types["head"])
            cases.append((HEADS[model][0], head, types["head"]))
        for what, (dense, packed), qtype in cases:
            wins = []
            for m in rows:
                t = ab_rounds(arms_for(dense, packed, m), rounds, clock=now, budget_s=0.05)
                ratio = t["packed"] / t["dense"]
                wins += [m] if ratio <= 1.0 else []
                print(f"{model:>5} {what:>16} {qtype:>5} {m:>4} {1e3 * t['dense']:9.2f} "
                      f"{1e3 * t['packed']:9.2f} {1e3 * t['vnni']:9.2f} {ratio:12.2f} "
                      f"{t['vnni'] / t['dense']:10.2f}", flush=True)
            print(f"{model} {what}: packed at most as slow as dense up to M = "
                  f"{max(wins) if wins else 'none'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="135M,1B")
    p.add_argument("--layer-type", default="Q4_1", help="the decoder linears' GGUF type")
    p.add_argument("--head-type", default="Q8_0", help="the (tied) lm_head's GGUF type")
    p.add_argument("--rows", default="1,4,16,32,64,128,256,512")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("needs the CPU kernels")
    for t in (args.layer_type, args.head_type):
        if t not in GGUF_TYPES:
            raise SystemExit(f"unknown GGUF type {t}; one of {', '.join(GGUF_TYPES)}")
    print(f"gguf kernel: {ops.gguf_kernel()}, dense kernel: {ops.dense_linear_kernel()}")
    run(ops, args.models.split(","), {"layer": args.layer_type, "head": args.head_type},
        [int(r) for r in args.rows.split(",")], args.rounds, args.threads)


if __name__ == "__main__":
    main()
