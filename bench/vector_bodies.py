"""The CPU kernels' AVX-512 BF16 vector bodies against what runs without them, side by side.

    python bench/vector_bodies.py [--rounds 3]

On a CPU without AMX (AMD Zen 4, Intel before Sapphire Rapids) two kernels run on vectors:
the prefill attention kernel (paged_attention_prefill, against the gather + SDPA path the
backend takes without it) and dense_linear (decode-sized bf16 linears, against oneDNN on a
weight packed for few rows, as pagedserve_kernels/cpu_linear.py packs it). Each round times both
sides of every case alternately and prints their times and the ratio (kernel / other: below 1, the
kernel wins). On an AMX CPU, --body avx512_bf16 times the vector bodies there.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from pagedserve_kernels.backend import AttentionMetadata
from pagedserve_kernels.cpu_backend import CpuAttentionBackend
from pagedserve_kernels.cpu_ops import load_cpu_ops
from pagedserve_kernels.reference import TorchAttentionBackend

# (query heads, KV heads, head_dim, query lengths, context lengths): SmolLM2-135M's prompts
# (two 256-token prompts, a 128-token chunk after a 512-token prefix), a Llama-3-8B-like shape.
PREFILL_CASES = [
    (9, 3, 64, [256, 256], [256, 256]),
    (9, 3, 64, [128], [640]),
    (32, 8, 128, [512], [512]),
]
# (rows, out, in): SmolLM2-135M's qkv, o, gate_up, down and lm_head at 1, 4 and 32 rows
LINEAR_CASES = [
    (m, n, k)
    for m in (1, 4, 32)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
]


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def paged_case(heads, kv_heads, d, q_lens, kv_lens, gen, block_size=16):
    """Shuffled blocks holding each sequence's context; the metadata the backends read."""
    blocks = [-(n // -block_size) for n in kv_lens]
    total = sum(blocks)
    k = torch.randn(total, block_size, kv_heads, d, generator=gen).bfloat16()
    v = torch.randn(total, block_size, kv_heads, d, generator=gen).bfloat16()
    ids = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[at : at + n]
        at += n
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=table,
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(kv_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
    )
    q = torch.randn(sum(q_lens), heads, d, generator=gen).bfloat16()
    return q, k, v, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--body", choices=("default", "avx512_bf16"), default="default",
                   help="avx512_bf16: the vector bodies even where AMX is")
    args = p.parse_args()
    ops = load_cpu_ops()
    if ops is None or not ops.prefill_supported(64, 16) or not ops.dense_linear_kernel():
        raise SystemExit("the CPU kernels have no AVX-512 BF16 (or AMX) body here")
    if args.body == "avx512_bf16":
        ops.set_amx_prefill(False)
        ops.set_amx_dense_linear(False)
    print(f"prefill kernel: {ops.prefill_kernel(64, 16)}, dense_linear: "
          f"{ops.dense_linear_kernel()}, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    kernel_backend, sdpa_backend = CpuAttentionBackend(ops), TorchAttentionBackend()
    prefill = [paged_case(*c, gen) for c in PREFILL_CASES]
    linears = []
    for m, n, k in LINEAR_CASES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        linears.append((torch.randn(m, k, generator=gen).bfloat16(), ops.amx_pack_weight(w),
                        torch.ops.mkldnn._reorder_linear_weight(w, 32),
                        torch.empty(m, n, dtype=torch.bfloat16)))
    for r in range(1, args.rounds + 1):
        print(f"round {r}")
        for case, (q, k, v, meta) in zip(PREFILL_CASES, prefill):
            scale = case[2] ** -0.5
            kern = timed(partial(kernel_backend.forward, q, k, v, meta, scale), 10)
            sdpa = timed(partial(sdpa_backend.forward, q, k, v, meta, scale), 10)
            print(f"  prefill h{case[0]}/{case[1]} d{case[2]} q{case[3]} of {case[4]}: kernel "
                  f"{kern:.3f} ms, SDPA {sdpa:.3f} ms, ratio {kern / sdpa:.2f}")
        for (m, n, k), (x, packed, onednn_w, out) in zip(LINEAR_CASES, linears):
            reps = 10 if n > 10000 else 200
            kern = timed(partial(ops.dense_linear, out, x, packed, None), reps)
            onednn = torch.ops.mkldnn._linear_pointwise
            dnn = timed(partial(onednn, x, onednn_w, None, "none", [], ""), reps)
            print(f"  linear {m} x {k} -> {n}: dense_linear {kern:.3f} ms, oneDNN {dnn:.3f} ms,"
                  f" ratio {kern / dnn:.2f}")


if __name__ == "__main__":
    main()
