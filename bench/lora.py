"""Multi-LoRA cost: output tokens/s, decode step time and TTFT with 1, 4 and 16 adapters
against the base model alone, at 8 and 32 requests at once (in-process, no HTTP).

    python bench/lora.py [--dtype bfloat16] [--rank 16] [--prompt-len 64] [--max-tokens 32]
    OMP_NUM_THREADS=1 python bench/lora.py --vllm --concurrency 8   (vs vLLM's CPU build)

Adapters are random rank-r LoRAs on every q/k/v/o/gate/up/down of the default model (PEFT's
layout, written directly); requests take them round robin; --max-loras 16 so a step can hold
every adapter it has requests for. One engine per concurrency serves every row of that
concurrency, so the rows differ only in the adapters the requests name.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

import engine.runner.model_runner as model_runner
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A random PEFT adapter folder for the model of `cfg` (an HF config)."""
    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or d
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "peft_type": "LORA"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run_round(engine: LLMEngine, prompts, names, max_tokens: int, steps: dict) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for key in steps:
        steps[key] = [0, 0.0]
    t0 = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=name)
    num_tokens, ttfts = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            num_tokens += len(out.outputs[0].token_ids)
            if out.finished:
                m = out.metrics
                ttfts.append(m.first_token_time - m.arrival_time)
    elapsed = time.perf_counter() - t0
    n_dec, t_dec = steps["decode"]
    return {
        "tok_s": num_tokens / elapsed,
        "decode_ms": 1000 * t_dec / max(n_dec, 1),
        "ttft_ms": 1000 * sum(ttfts) / len(ttfts),
    }


def time_steps() -> dict:
    steps = {"decode": [0, 0.0], "prefill/mixed": [0, 0.0]}
    execute = model_runner.ModelRunner.execute

    def timed(self, out):
        t = time.perf_counter()
        result = execute(self, out)
        kind = "decode" if sum(out.num_scheduled_tokens) == len(out.requests) else "prefill/mixed"
        steps[kind][0] += 1
        steps[kind][1] += time.perf_counter() - t
        return result

    model_runner.ModelRunner.execute = timed
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--vllm", action="store_true", help="base, 1 and 4 adapters vs vLLM's CPU")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / "bench" / ".venv-vllm")
    args = p.parse_args()
    if args.vllm:
        from lora_vllm import compare  # bench/lora_vllm.py

        model = resolve_model(None)
        cfg = AutoConfig.from_pretrained(model)
        tmp = Path(tempfile.mkdtemp(prefix="lora-vllm-"))
        adapters = [write_adapter(tmp / f"a{i}", cfg, args.rank, i) for i in range(4)]
        compare(str(model), adapters, args, random.Random(0))
        return
    steps = time_steps()
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    rng = random.Random(0)
    print(f"{'c':>3} {'adapters':>8} {'tok/s':>8} {'x base':>7} {'decode ms':>10} {'TTFT ms':>8}")
    for c in args.concurrency:
        mods: tuple[str, ...] = ()
        engine, base = None, 1.0
        for n in (0, 1, 4, 16):
            if engine is None:
                cfg = AutoConfig.from_pretrained(resolve_model(None))
                mods = tuple(
                    f"a{i}={write_adapter(tmp / f'c{c}-a{i}', cfg, args.rank, i)}"
                    for i in range(16)
                )
                engine = LLMEngine(
                    EngineConfig(
                        dtype=args.dtype, max_num_seqs=c, enable_lora=True, lora_modules=mods,
                        max_loras=16, max_lora_rank=args.rank, max_cpu_loras=16,
                    )
                )  # fmt: skip
                warm = [[rng.randrange(100, 40000) for _ in range(8)]] * 2
                run_round(engine, warm, [None, "a0"], 4, steps)
            prompts = [
                [rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(c)
            ]
            names = [None if n == 0 else f"a{i % n}" for i in range(c)]
            r = run_round(engine, prompts, names, args.max_tokens, steps)
            if n == 0:
                base = r["tok_s"]
            print(
                f"{c:>3} {n if n else 'base':>8} {r['tok_s']:>8.1f} {r['tok_s'] / base:>7.2f} "
                f"{r['decode_ms']:>10.1f} {r['ttft_ms']:>8.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
