"""One decode step of the default model with LoRA adapters in the batch, against base only.

    python bench/micro/lora_decode.py [--concurrency 8 32] [--adapters 0 1 4] [--rounds 5]
    OMP_NUM_THREADS=1 python bench/micro/lora_decode.py --clock cpu   # on a busy machine

Per concurrency c, one engine per arm (--enable-lora, --max-loras 4, rank --rank on all seven
targets q/k/v/o/gate/up/down, random weights in PEFT's layout):
c requests of a short prompt, decoding with ignore_eos; once all decode, the arms' engine.step()
calls run interleaved (harness.ab_rounds) and each keeps its best round. Prints the step time
and its ratio to the base-only arm (whose batch runs the fused decode step, as in serving).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
from harness import CLOCKS, ab_rounds, add_clock_arg, ratio_table
from safetensors.torch import save_file
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model
from engine.sampling_params import SamplingParams

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter (rank `rank` on all seven targets) for the model of HF config cfg."""
    h = cfg.hidden_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for part, names in TARGETS.items():
            for name in names:
                n_in, n_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    targets = [n for names in TARGETS.values() for n in names]
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "peft_type": "LORA"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def decoding_engine(c: int, n_adapters: int, mods, args, rng) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            dtype=args.dtype, max_num_seqs=c, max_model_len=1024, enable_lora=True,
            lora_modules=mods, max_loras=4, max_lora_rank=args.rank, max_cpu_loras=4,
        )
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    for i in range(c):
        prompt = [rng.randrange(100, 40000) for _ in range(16)]
        name = None if n_adapters == 0 else f"a{i % n_adapters}"
        engine.add_request(f"r{i}", prompt, params, lora_name=name)
    for _ in range(4):  # prefill, then a few decode steps
        engine.step()
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.3, help="seconds per arm per round")
    add_clock_arg(p)
    args = p.parse_args()
    cfg = AutoConfig.from_pretrained(resolve_model(None))
    tmp = Path(tempfile.mkdtemp(prefix="lora-micro-"))
    mods = tuple(f"a{i}={write_adapter(tmp / f'a{i}', cfg, args.rank, i)}" for i in range(4))
    rng = random.Random(0)
    for c in args.concurrency:
        engines = {n: decoding_engine(c, n, mods, args, rng) for n in args.adapters}
        arms = {("base" if n == 0 else f"{n} adapter(s)"): e.step for n, e in engines.items()}
        best = ab_rounds(arms, args.rounds, budget_s=args.budget, clock=CLOCKS[args.clock])
        print(f"c={c}, {args.dtype}, rank {args.rank}, decode step:", flush=True)
        ratio_table(best.items(), ratio="x base")
        del engines, arms


if __name__ == "__main__":
    main()
