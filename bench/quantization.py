"""bf16 against --quantization int8 on the default model (SmolLM2-135M), side by side, one run.

    python bench/quantization.py --rounds 3

Per arm (one LLM each, both loaded in this process, runs interleaved because the machine drifts):
weight bytes of the decoder linears as held, c=1 decode time per output token (one 256-token
prompt, 129 output tokens, minus the same prompt with 1 output token, over 128), and prefill
tokens/s (8 prompts of 256 tokens, one output token each). Then the M=1 linears alone: each of
the model's linear shapes through the bf16 packed linear and int8_linear, time per call and the
weight bytes streamed per second (a memory-bound GEMV runs near the machine's bandwidth).
--layered adds bf16 decoding layer by layer (no fused decode step), which is how int8 decodes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine.layers.linear import Linear
from engine.layers.quantization import Int8Weights, linear_weight_bytes
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.cpu_linear import PackedLinear
from kernels.cpu_ops import load_cpu_ops


def ids(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(k)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


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
    for r in range(rounds):
        order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
        for name, llm in order:
            prompt = [ids(rng, 256)]  # fresh tokens: no prefix-cache hits
            one = timed(llm, prompt, 1)
            full = timed(llm, [prompt[0][::-1]], 129)
            tpot[name].append((full - one) / 128)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemv-reps", type=int, default=2000)
    p.add_argument("--layered", action="store_true", help="also bf16 without the fused decode")
    args = p.parse_args()
    ops = load_cpu_ops()
    print(f"int8 kernel: {ops.int8_kernel() if ops is not None else 'torch (no C++ kernels)'}")
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
