"""Where one c=1 decode step of the default model served packed spends its time.

    OMP_NUM_THREADS=2 python bench/gguf_profile.py --types Q4_0,Q8_0
    OMP_NUM_THREADS=1 python bench/gguf_profile.py --clock cpu     # on a busy machine

Per type (bench/quantization.py quantized_default: every decoder linear of that type, the tied
lm_head in Q8_0), one LLM served packed decodes a 256-token prompt; the last fused decode
step's inputs are kept and its parts replayed, each the median over --reps:

    step       the fused decode step (decode_layers_mixed through every layer), as the runner
               calls it
    linears    per projection, the layers' gguf_linear calls in layer order on the model's own
               packed weights (so each streams from where the step finds it), minus the cost of
               a call that returns at once (M=0); with the weight bytes streamed per second
    attention  paged_attention_decode per layer on the step's caches and block table
    glue       the step minus those: norms, rope, KV writes, SiLU, allocations (the small
               kernels alone on the next line)
    lm_head    compute_logits on the step's output (the tied packed head, then float32), each
               right after a step
    embed      the packed embedding's row gather for the new token
    rest       the measured time per output token (129 minus 1 output tokens, over 128) minus
               all of the above: sampling, scheduler, detokenizer, the engine loop

"hot" is one weight called over and over (an L2-sized one stays in cache): the kernel's own
ceiling. Then the machine's read bandwidth: a sum over a uint8 tensor of L2, L3 and DRAM sizes
with 1 and the configured threads.

    OMP_NUM_THREADS=1 python bench/gguf_profile.py --clock cpu --scales-ab --rounds 5

--scales-ab: instead, per type, the linears row of the same model loaded twice, as served
(fp16 scales for the 32-weight types) and with float32 scales and mins (the layout before
them), timed interleaved over --rounds, the order reversed every other round; median per arm.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from quantization import f32_scales, per_output_token, quantized_default  # bench/

from engine.layers.quantization.gguf import GGUF_PACKED_ENV, GGUFWeights
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pagedserve_kernels.cpu_ops import load_cpu_ops

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: this thread's CPU time
clock = CLOCKS["wall"]


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def capture_step(llm: LLM):
    """Decodes one prompt; returns the last fused step's (input_ids, positions, meta, caches)."""
    fused = llm.engine.runner.fused_decode
    assert fused is not None, "the packed model must take the fused decode step"
    seen, run = [], fused.run

    def spy(*args):
        seen[:] = [args]
        return run(*args)

    fused.run = spy
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    fused.run = run
    return seen[0]


def linear_calls(quant: GGUFWeights, x: torch.Tensor, out: torch.Tensor):
    """The gguf_linear calls of one packed linear, part by part, as decode_layers_mixed makes."""
    calls, start = [], 0
    for p in quant.parts:
        o = out[:, start : start + p.out_features]
        calls.append((o, x, p.qs, p.qh, p.scales, p.mins, p.bits, p.zero, None))
        start += p.out_features
    return calls


def profile(llm: LLM, ops, reps: int, rounds: int) -> list[tuple[str, float, float | None]]:
    """(component, seconds per step, weight bytes or None) rows."""
    model = llm.engine.runner.model
    fused = llm.engine.runner.fused_decode
    input_ids, positions, meta, caches = capture_step(llm)
    layers = model.model.layers
    x = model.model.embed_tokens(input_ids)
    cos_sin = model.rotary.cos_sin_cache(meta.max_seq_len, x.dtype)
    hidden = fused.step(x, positions, cos_sin, meta, caches)
    rows = [("step", median_s(lambda: fused.step(x, positions, cos_sin, meta, caches), reps), None)]
    kinds = layer_calls(layers, x.dtype)
    spent = time_linears(ops, kinds, call_cost(ops, layers, reps), reps)
    for kind in KINDS:
        rows.append((kind_name(layers, kind), spent[kind], kind_bytes(layers, kind)))
    attn = layers[0].self_attn.attn
    q = torch.randn(1, attn.num_heads, attn.head_dim, dtype=x.dtype)
    o = torch.empty_like(q)

    def attention():
        for k_cache, v_cache in caches:
            ops.paged_attention_decode(o, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                                       attn.scale, 0, 0.0)

    rows.append(("attention", median_s(attention, reps), None))
    rows.append(("glue", rows[0][1] - sum(r[1] for r in rows[1:]), None))
    rows.append(("  of it the small kernels", small_kernels(ops, llm, x, positions, cos_sin,
                                                            meta, caches, reps), None))
    head = model.lm_head.quant
    after = []  # each right after a step, so that its weights stream as in a decode step
    for _ in range(reps):
        fused.step(x, positions, cos_sin, meta, caches)
        start = clock()
        model.compute_logits(hidden)
        after.append(clock() - start)
    rows.append((f"lm_head {head.out_features}x{head.in_features} {'+'.join(head.qtypes())}",
                 statistics.median(after), head.num_bytes()))
    rows.append(("embed gather", median_s(lambda: model.model.embed_tokens(input_ids), reps),
                 None))
    rng = random.Random(1)
    token = min(per_output_token(llm, rng, clock) for _ in range(rounds))
    rows.append(("rest", token - rows[0][1] - sum(r[1] for r in rows[-2:]), None))
    rows.append(("per output token (measured)", token, None))
    return rows


def _mod(layer, kind: str):
    return getattr(layer.self_attn if kind in KINDS[:2] else layer.mlp, kind)


def layer_calls(layers, dtype: torch.dtype) -> dict[str, list]:
    """Per projection kind, the gguf_linear calls of every layer (M=1), in layer order."""
    kinds = {k: [] for k in KINDS}
    for layer in layers:
        for kind in KINDS:
            quant = _mod(layer, kind).quant
            xin = torch.randn(1, quant.in_features, dtype=dtype)
            out = xin.new_empty(1, quant.out_features)
            kinds[kind].append(linear_calls(quant, xin, out))
    return kinds


def call_cost(ops, layers, reps: int) -> float:
    """Seconds of a gguf_linear call that returns at once (M=0)."""
    p0 = layers[0].self_attn.qkv_proj.quant.parts[0]
    dtype = torch.bfloat16
    empty = (torch.empty(0, p0.out_features, dtype=dtype),
             torch.empty(0, p0.in_features, dtype=dtype), p0.qs, p0.qh, p0.scales, p0.mins,
             p0.bits, p0.zero, None)
    return median_s(lambda: [ops.gguf_linear(*empty) for _ in range(100)], reps) / 100


def time_linears(ops, kinds: dict[str, list], cost: float, reps: int) -> dict[str, float]:
    """Per kind, the median over reps of its calls' time summed over the layers (each call
    timed alone, in layer order, minus cost)."""
    spent = {k: [] for k in KINDS}
    layers = len(kinds[KINDS[0]])
    for _ in range(reps):
        acc = dict.fromkeys(KINDS, 0.0)
        for i in range(layers):
            for kind in KINDS:
                for call in kinds[kind][i]:
                    start = clock()
                    ops.gguf_linear(*call)
                    acc[kind] += clock() - start - cost
        for kind in KINDS:
            spent[kind].append(acc[kind])
    return {kind: statistics.median(spent[kind]) for kind in KINDS}


def kind_name(layers, kind: str) -> str:
    q = _mod(layers[0], kind).quant
    return f"{kind} {q.out_features}x{q.in_features} {'+'.join(q.qtypes())}"


def kind_bytes(layers, kind: str) -> int:
    return sum(_mod(layer, kind).quant.num_bytes() for layer in layers)


def scales_ab(qtype: str, ops, reps: int, rounds: int, kw: dict) -> None:
    """The linears of qtype's model as served against float32 scales, interleaved."""
    arms = {"served": LLM(str(quantized_default(qtype)), **kw)}
    with f32_scales():
        arms["f32 scales"] = LLM(str(quantized_default(qtype)), **kw)
    layers = {name: llm.engine.runner.model.model.layers for name, llm in arms.items()}
    calls = {name: layer_calls(lay, torch.bfloat16) for name, lay in layers.items()}
    cost = call_cost(ops, layers["served"], reps)
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in arms}
    for r in range(rounds):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            for kind, sec in time_linears(ops, calls[name], cost, reps).items():
                times[name][kind].append(sec)
    print(f"\n{qtype}: the linears per decode step (M=1, {len(layers['served'])} layers), "
          f"median of {rounds} rounds")
    served = layers["served"][0].self_attn.qkv_proj.quant.parts[0].scales.dtype
    print(f"{'projection':34} {'served ms':>9} {'f32 ms':>7} {'ratio':>6} {'MiB':>6} "
          f"{'f32 MiB':>7} {'GB/s':>5} {'f32':>5}  (served scales: {served})")
    total = dict.fromkeys(arms, 0.0)
    for kind in KINDS:
        med = {n: statistics.median(times[n][kind]) for n in arms}
        size = {n: kind_bytes(layers[n], kind) for n in arms}
        for n in arms:
            total[n] += med[n]
        print(f"{kind_name(layers['served'], kind):34} {1e3 * med['served']:9.3f} "
              f"{1e3 * med['f32 scales']:7.3f} {med['served'] / med['f32 scales']:6.3f} "
              f"{size['served'] / 2**20:6.1f} {size['f32 scales'] / 2**20:7.1f} "
              f"{size['served'] / med['served'] / 1e9:5.1f} "
              f"{size['f32 scales'] / med['f32 scales'] / 1e9:5.1f}", flush=True)
    print(f"{'all linears':34} {1e3 * total['served']:9.3f} {1e3 * total['f32 scales']:7.3f} "
          f"{total['served'] / total['f32 scales']:6.3f}")
    del arms


def small_kernels(ops, llm, x, positions, cos_sin, meta, caches, reps: int) -> float:
    """Per step: the norms, rope, KV write and SiLU-and-mul of every layer, called alone."""
    model = llm.engine.runner.model
    layer0 = model.model.layers[0]
    attn = layer0.self_attn.attn
    hidden = x.shape[1]
    inter = layer0.mlp.gate_up_proj.quant.out_features
    res, xx = torch.randn(1, hidden, dtype=x.dtype), torch.randn(1, hidden, dtype=x.dtype)
    w = layer0.input_layernorm.weight
    q = torch.randn(1, attn.num_heads, attn.head_dim, dtype=x.dtype)
    k = torch.randn(1, attn.num_kv_heads, attn.head_dim, dtype=x.dtype)
    gate_up = torch.randn(1, inter, dtype=x.dtype)
    h = x.new_empty(1, inter // 2)
    eps = model.model.norm.eps

    def run():
        for k_cache, v_cache in caches:
            ops.fused_add_rms_norm(xx, res, w, eps)
            ops.rotary_embedding(positions, q, k, cos_sin)
            ops.write_kv(k, k, k_cache, v_cache, meta.slot_mapping)
            ops.fused_add_rms_norm(xx, res, w, eps)
            ops.silu_and_mul(h, gate_up)

    return median_s(run, reps)


def bandwidth(threads: int) -> list[tuple[str, float]]:
    """Read GB/s at L2, L3 and DRAM sizes, with 1 and `threads` threads: the max of an int32
    tensor (vectorized, so it runs at what memory delivers; torch's uint8 sum does not)."""
    out = []
    for mib in (1, 32, 1024):
        t = torch.ones(mib << 18, dtype=torch.int32)
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            reps = max(3, 256 // mib)
            rate = 4 * t.numel() / median_s(t.amax, reps)
            out.append((f"int32 max {mib} MiB, {n} thread(s)", rate))
        del t
    torch.set_num_threads(threads)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--types", default="Q4_0,Q8_0")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2, help="end-to-end rounds per type")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="cpu: the thread's CPU time, robust to other load (OMP_NUM_THREADS=1)")
    p.add_argument("--scales-ab", action="store_true",
                   help="the linears as served against float32 scales, interleaved")
    args = p.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu counts one thread: run with OMP_NUM_THREADS=1")
    ops = load_cpu_ops()
    threads = torch.get_num_threads()
    print(f"{threads} threads, {args.clock} clock, gguf kernel {ops.gguf_kernel()}")
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    os.environ[GGUF_PACKED_ENV] = "1"
    if args.scales_ab:
        for qtype in args.types.split(","):
            scales_ab(qtype, ops, args.reps, args.rounds, kw)
        return
    for qtype in args.types.split(","):
        llm = LLM(str(quantized_default(qtype)), **kw)
        rows = profile(llm, ops, args.reps, args.rounds)
        token = rows[-1][1]
        print(f"\n{qtype}: c=1 decode step, default model")
        print(f"{'component':38} {'ms':>7} {'share':>6} {'MiB':>6} {'GB/s':>6}")
        for name, sec, nbytes in rows:
            mib = f"{nbytes / 2**20:6.1f}" if nbytes else f"{'':6}"
            rate = f"{nbytes / sec / 1e9:6.1f}" if nbytes else f"{'':6}"
            print(f"{name:38} {1e3 * sec:7.3f} {100 * sec / token:5.1f}% {mib} {rate}",
                  flush=True)
        print("hot (one weight over and over):")
        layer = llm.engine.runner.model.model.layers[0]
        for kind in KINDS:
            quant = getattr(layer.self_attn if kind in KINDS[:2] else layer.mlp, kind).quant
            xin = torch.randn(1, quant.in_features, dtype=torch.bfloat16)
            out = xin.new_empty(1, quant.out_features)
            calls = linear_calls(quant, xin, out)
            sec = median_s(lambda calls=calls: [ops.gguf_linear(*c) for c in calls],
                           10 * args.reps)
            print(f"  {kind:14} {1e6 * sec:7.1f} us {quant.num_bytes() / sec / 1e9:6.1f} GB/s")
        del llm
    print("\nread bandwidth")
    for name, rate in bandwidth(threads):
        print(f"  {name:32} {rate / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
