"""Attention side by side: per-sequence reference, batched torch, Triton (CUDA only), and the
sliding-window case on the backends.

    python bench/micro/attention_decode.py [--batch 32] [--context 512] [--device cpu|cuda]
    python bench/micro/attention_decode.py --window-case [--context 4096] [--window 512] [--batch 8]
                                     [--threads N]

Default: SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), block_size 16, blocks
scattered in the cache; prints each decode path's median time and its speed-up over the
reference.

--window-case: Gemma 3 270M's shapes (4 query heads, 1 KV head, head_dim 256), every sequence at
--context tokens: decode (--batch sequences, one new token each), a chunked-prefill step (512
new tokens at the end of the context) and a whole prompt of --context tokens, each with full
attention and with a --window sliding window, in float32 and bf16, through the attention
backend (on CPU the C++ kernels) and through the torch oracle (TorchAttentionBackend). Times
are the best of --repeat runs (a shared machine's other load only ever adds time); --threads
sets torch's intra-op threads (1 keeps a busy machine's stragglers out of the numbers).

--head-dim-case: Llama-sized attention (32 query heads over 32 or 8 KV heads) at head_dim 64, 96
(Phi-3-mini) and 128, contexts --contexts, block_size 16, float32 and bf16: decode (--batch
sequences, one new token each) and prefill (the last 512 tokens of the context, or all of it if
shorter) through the attention backend, with the kernel each takes (ops.decode_kernel for
decode; "amx" or "sdpa" for prefill), the best of --repeat times, that time per (query head x
key x head dim) so that head_dims compare, and the relative error against the torch oracle.
--clock cpu counts the process's CPU seconds (with OMP_NUM_THREADS=1 or --threads 1: the
work, whatever else the machine runs).

    python bench/micro/attention_decode.py --head-dim-case [--batch 8] [--contexts 512,2048]
                                     [--threads 1] [--clock cpu] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import CLOCKS, add_clock_arg, measure

from pagedserve_kernels import get_attention_backend
from pagedserve_kernels.backend import AttentionMetadata
from pagedserve_kernels.reference import (
    TorchAttentionBackend,
    paged_attention,
    paged_decode_attention,
)

SMOLLM2 = (9, 3, 64)  # num_heads, num_kv_heads, head_dim
GEMMA3_270M = (4, 1, 256)
HEAD_DIM_SHAPES = [(32, kv, d) for d in (64, 96, 128) for kv in (32, 8)]  # Llama / Phi-3-mini


def make_cache(lens, shape, device, dtype, gen, block_size=16):
    """Caches holding every sequence's blocks in shuffled order, and the block table."""
    _, num_kv_heads, head_dim = shape
    num_blocks = [-(n // -block_size) for n in lens]
    total = sum(num_blocks)
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(num_blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(num_blocks):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return k_cache.to(device, dtype), v_cache.to(device, dtype), table.to(device)


def make_meta(query_lens, seq_lens, table, device) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def make_inputs(batch: int, context: int, device: str, dtype: torch.dtype, shape=SMOLLM2):
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(context // 2, context + 1, (batch,), generator=gen).tolist()
    k_cache, v_cache, table = make_cache(lens, shape, device, dtype, gen)
    q = torch.randn(batch, shape[0], shape[2], generator=gen).to(device, dtype)
    return q, k_cache, v_cache, make_meta([1] * batch, lens, table, device)


def median_ms(fn, device: str, repeat: int, stat=statistics.median, clock=time.perf_counter):
    sync = torch.cuda.synchronize if device == "cuda" else None
    return 1e3 * measure(fn, repeat, stat=stat, clock=clock, sync=sync)


def decode_paths(args) -> None:
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
        from pagedserve_kernels.triton_attention import paged_decode_attention as triton_decode

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


def window_case(args) -> None:
    """Gemma 3 270M's attention with and without a sliding window, backend against oracle."""
    backend = get_attention_backend("auto", args.device)
    oracle = TorchAttentionBackend()
    ctx, shape = args.context, GEMMA3_270M
    phases = {  # name: (query lens, seq lens)
        f"decode x{args.batch}": ([1] * args.batch, [ctx] * args.batch),
        "prefill 512 of ctx": ([512], [ctx]),
        "prompt of ctx": ([ctx], [ctx]),
    }
    print(
        f"attention, Gemma 3 270M shapes (H {shape[0]}, Hkv {shape[1]}, D {shape[2]}), "
        f"context {ctx}, window {args.window}, {args.device}, backend {type(backend).__name__}, "
        f"{torch.get_num_threads()} threads, best of {args.repeat}"
    )
    print(f"  {'phase':20s} {'dtype':9s} {'window':>6s} {'backend ms':>11s} {'oracle ms':>10s}"
          f"  rel err")
    for dtype in (torch.float32, torch.bfloat16):
        for phase, (q_lens, seq_lens) in phases.items():
            gen = torch.Generator().manual_seed(1)
            k_cache, v_cache, table = make_cache(seq_lens, shape, args.device, dtype, gen)
            meta = make_meta(q_lens, seq_lens, table, args.device)
            q = torch.randn(sum(q_lens), shape[0], shape[2], generator=gen).to(args.device, dtype)
            inputs = (q, k_cache, v_cache, meta, shape[2] ** -0.5)
            for window in (0, args.window):
                ms, ms_oracle, err = time_both(backend, oracle, inputs, window, args)
                name = str(dtype).removeprefix("torch.")
                print(f"  {phase:20s} {name:9s} {window or 'full':>6} {ms:11.3f} "
                      f"{ms_oracle:10.3f}  {err:.1e}")


def time_both(backend, oracle, inputs, window: int, args) -> tuple[float, float, float]:
    """(backend ms, oracle ms, relative error of the backend against the oracle)."""
    def run(b):
        return b.forward(*inputs, window=window)

    want = run(oracle).float()
    err = ((run(backend).float() - want).norm() / want.norm()).item()
    ms = median_ms(lambda: run(backend), args.device, args.repeat, min)
    return ms, median_ms(lambda: run(oracle), args.device, args.repeat, min), err


def head_dim_case(args) -> None:
    """Decode and prefill at head_dim 64, 96 and 128: the kernel each takes and its time."""
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    backend = get_attention_backend("auto", "cpu")
    oracle = TorchAttentionBackend()
    clock = CLOCKS[args.clock]
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"attention by head_dim, block_size 16, decode batch {args.batch}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, best of {args.repeat}, "
        f"backend {type(backend).__name__}"
    )
    print(f"  {'H/Hkv':>6s} {'D':>4s} {'ctx':>5s} {'dtype':9s} {'phase':8s} {'kernel':12s}"
          f" {'ms':>9s} {'ps/(h.key.d)':>13s}  rel err")
    for shape in HEAD_DIM_SHAPES:
        heads, kv_heads, head_dim = shape
        for ctx in contexts:
            for dtype in (torch.float32, torch.bfloat16):
                new = min(512, ctx)
                phases = {"decode": ([1] * args.batch, [ctx] * args.batch),
                          "prefill": ([new], [ctx])}
                for phase, (q_lens, seq_lens) in phases.items():
                    gen = torch.Generator().manual_seed(2)
                    k_cache, v_cache, table = make_cache(seq_lens, shape, "cpu", dtype, gen)
                    meta = make_meta(q_lens, seq_lens, table, "cpu")
                    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
                    kernel = _kernel_name(ops, backend, phase, q, k_cache, meta)

                    def run(b, inputs=(q, k_cache, v_cache, meta, head_dim**-0.5)):
                        return b.forward(*inputs)

                    want = run(oracle).float()
                    err = ((run(backend).float() - want).norm() / want.norm()).item()
                    ms = median_ms(lambda: run(backend), "cpu", args.repeat, min, clock)
                    # keys each query reads: the causal prefill's queries see ctx - new + j + 1
                    keys = sum(q_lens) * ctx if phase == "decode" else new * (ctx - new / 2)
                    ps = ms * 1e9 / (keys * heads * head_dim)
                    name = str(dtype).removeprefix("torch.")
                    print(f"  {heads:>3d}/{kv_heads:<2d} {head_dim:4d} {ctx:5d} {name:9s}"
                          f" {phase:8s} {kernel:12s} {ms:9.3f} {ps:13.2f}  {err:.1e}", flush=True)


def _kernel_name(ops, backend, phase: str, q, k_cache, meta) -> str:
    """The kernel a phase takes: decode_kernel's answer (inferred on a build without it)."""
    if phase == "prefill":
        return "amx" if backend._prefill_kernel_applies(q, k_cache, meta) else "sdpa"
    try:
        return ops.decode_kernel(q, k_cache)
    except (AttributeError, RuntimeError):  # a build from before decode_kernel: its rules
        d, bf16 = q.shape[2], q.dtype == torch.bfloat16
        if bf16 and d % 64 == 0 and k_cache.shape[1] % 16 == 0 and ops.amx_available():
            return "amx"
        if d in (64, 128, 256):
            return "avx512_seq" if q.shape[0] >= 2 * torch.get_num_threads() else "avx512_head"
        return "portable"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=None, help="32; 8 with --window-case")
    ap.add_argument("--context", type=int, default=None, help="512; 4096 with --window-case")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--window-case", action="store_true", help="Gemma 3 270M, window vs full")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--head-dim-case", action="store_true", help="head_dim 64, 96, 128")
    ap.add_argument("--contexts", default="512,2048", help="with --head-dim-case")
    add_clock_arg(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.head_dim_case:
        args.batch = args.batch or 8
        head_dim_case(args)
    elif args.window_case:
        args.batch, args.context = args.batch or 8, args.context or 4096
        window_case(args)
    else:
        args.batch, args.context = args.batch or 32, args.context or 512
        decode_paths(args)


if __name__ == "__main__":
    main()
