"""Decode attention side by side: per-sequence reference, batched torch, Triton (CUDA only).

    python bench/attention_decode.py [--batch 32] [--context 512] [--device cpu|cuda]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), block_size 16, blocks
scattered in the cache. Prints each path's median time and its speed-up over the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.backend import AttentionMetadata
from kernels.reference import paged_attention, paged_decode_attention


def make_inputs(batch: int, context: int, device: str, dtype: torch.dtype, block_size: int = 16):
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(context // 2, context + 1, (batch,), generator=gen).tolist()
    num_blocks = [-(n // -block_size) for n in lens]
    total = sum(num_blocks)
    k_cache = torch.randn(total, block_size, 3, 64, generator=gen).to(device, dtype)
    v_cache = torch.randn(total, block_size, 3, 64, generator=gen).to(device, dtype)
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(batch, max(num_blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(num_blocks):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(batch, 9, 64, generator=gen).to(device, dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    return q, k_cache, v_cache, meta


def median_ms(fn, device: str, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    q, k_cache, v_cache, meta = make_inputs(args.batch, args.context, args.device, dtype)
    scale = 64**-0.5
    paths = {
        "per-sequence reference": lambda: paged_attention(q, k_cache, v_cache, meta, scale),
        "batched torch": lambda: paged_decode_attention(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.max_seq_len, scale
        ),
    }
    if args.device == "cuda":
        from kernels.triton_attention import paged_decode_attention as triton_decode

        paths["triton"] = lambda: triton_decode(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale
        )
    want = paths["per-sequence reference"]().float()
    base = None
    print(f"decode attention, batch {args.batch}, context <= {args.context}, {args.device}")
    for name, fn in paths.items():
        err = ((fn().float() - want).norm() / want.norm()).item()
        ms = median_ms(fn, args.device, args.repeat)
        base = base or ms
        print(f"  {name:24s} {ms:9.3f} ms  x{base / ms:6.2f}  rel err {err:.1e}")


if __name__ == "__main__":
    main()
