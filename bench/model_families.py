"""Prefill and decode tokens/s of pagedserve against transformers, per model family, one run.

For each family's tiny random-weight model (the builders of tests/test_model_families.py) and the
default model, both engines run the same weights in the same dtype on the same token ids:

- prefill: NUM_SEQS prompts of PROMPT_LEN tokens, one output token (pagedserve: LLM.generate;
  transformers: one forward of the padded-free [NUM_SEQS, PROMPT_LEN] batch);
- decode: the same prompts with DECODE_LEN greedy tokens, minus the prefill time, over
  NUM_SEQS * (DECODE_LEN - 1) tokens (transformers: generate on the static batch).

A family that falls off the CPU fast path shows up as a pagedserve / transformers ratio far
below the others'. Two real-shaped cases (two layers each, the byte tokenizer's vocabulary) put a
family's attention at its real head shape, where the tiny models' head_dim 16 cannot show it:
phi3-mini-shape (Phi-3-mini: hidden 3072, 32 heads of 96, MHA, intermediate 8192) beside
llama-3b-shape (Llama 3.2 3B: hidden 3072, 24 heads of 128 over 8 KV heads, intermediate 8192).
Ratios compare within one run only (the host is shared): each time is the best
of --rounds rounds with the two engines interleaved, and on a loaded host `--clock cpu` with
OMP_NUM_THREADS=1 counts the CPU seconds each engine spends instead of the wall time, which the
other processes' share of the cores dominates at these model sizes.

    python bench/model_families.py [--dtype bfloat16] [--families qwen2,phi3,phi3-mini-shape]
        [--no-default] [--rounds 3] [--clock wall|cpu] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
NUM_SEQS, PROMPT_LEN, DECODE_LEN = 8, 128, 32
MAX_POSITIONS = 1024  # tests/test_model_families.py build_family_dir's max_position_embeddings
_BIG = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=2, initializer_range=0.02)
# name -> (test family it is built from, config changes): real head shapes, two layers
REAL_SHAPES = {
    "phi3-mini-shape": ("phi3-d96", dict(_BIG, num_attention_heads=32, num_key_value_heads=32)),
    "llama-3b-shape": ("llama3", dict(_BIG, num_attention_heads=24, num_key_value_heads=8)),
}


def _families_module():
    sys.path.insert(0, str(TESTS))  # the test builders import conftest by name
    spec = importlib.util.spec_from_file_location("families", TESTS / "test_model_families.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prompts(vocab: int, prompt_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 259), (NUM_SEQS, prompt_len), generator=gen)
    return ids.tolist()


def _build(fam, name: str, path: Path) -> Path:
    if name in REAL_SHAPES:
        family, changes = REAL_SHAPES[name]
        return fam.build_family_dir(path, family, **changes)
    return fam.build_family_dir(path, name)


def _timed(run, n: int, clock) -> float:
    start = clock()
    run(n)
    return clock() - start


def pagedserve_runner(path: Path, dtype: str, prompts):
    """run(n): the prompts through pagedserve with n greedy tokens each."""
    from engine import LLM, SamplingParams

    # no prefix caching: every run prefills its prompts again
    llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=2048, enable_prefix_caching=False)

    def run(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)

    return run


def transformers_runner(path: Path, dtype: str, prompts):
    """run(n): transformers' generate on the static batch, n greedy tokens each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )

    return run


def measure(runs: dict, rounds: int, clock, prompt_len: int) -> dict[str, tuple[float, float]]:
    """name -> (prefill, decode) tokens/s, each the best of `rounds`, the engines interleaved
    round by round so that a burst of load on a shared host hits both."""
    for run in runs.values():
        run(2)  # warm-up (kernels, packing)
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            prefill = _timed(run, 1, clock)
            decode = _timed(run, DECODE_LEN, clock) - prefill
            best[name] = [min(best[name][0], prefill), min(best[name][1], max(decode, 1e-9))]
    return {name: _rates(*times, prompt_len) for name, times in best.items()}


def _rates(prefill_s: float, decode_s: float, prompt_len: int) -> tuple[float, float]:
    return NUM_SEQS * prompt_len / prefill_s, NUM_SEQS * (DECODE_LEN - 1) / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--families", default=None,
        help="comma-separated test families and " + ", ".join(REAL_SHAPES) + "; default all",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=PROMPT_LEN,
        help=f"at most {MAX_POSITIONS - DECODE_LEN - 1} (the built models' positions)",
    )
    parser.add_argument("--no-default", action="store_true", help="skip the default model")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, best kept")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu: process CPU seconds (with OMP_NUM_THREADS=1: the work, whatever the load)",
    )
    args = parser.parse_args()
    if not 1 <= args.prompt_len < MAX_POSITIONS - DECODE_LEN:
        parser.error(f"--prompt-len must be in [1, {MAX_POSITIONS - DECODE_LEN - 1}]")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    fam = _families_module()
    names = args.families.split(",") if args.families else [*fam.MAIN_FAMILIES, *REAL_SHAPES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [(n, _build(fam, n, Path(tmp) / n)) for n in names]
        if not args.no_default:
            from engine.model_loader.loader import resolve_model

            models.append(("default (SmolLM2-135M)", resolve_model(None)))
        for name, path in models:
            from transformers import AutoConfig

            prompts = _prompts(AutoConfig.from_pretrained(path).vocab_size, args.prompt_len)
            runs = {
                "ps": pagedserve_runner(path, args.dtype, prompts),
                "hf": transformers_runner(path, args.dtype, prompts),
            }
            rates = measure(runs, args.rounds, clock, args.prompt_len)
            rows.append((name, rates["ps"], rates["hf"]))
            print(f"done {name}", file=sys.stderr, flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"dtype {args.dtype}, {NUM_SEQS} seqs x {args.prompt_len} prompt tokens,"
        f" {DECODE_LEN} decode, {args.clock} clock, best of {args.rounds} interleaved rounds,"
        f" load average {load}"
    )
    print("| model | prefill tok/s ps | hf | ps/hf | decode tok/s ps | hf | ps/hf |")
    print("|---|---|---|---|---|---|---|")
    for name, (pp, pd), (hp, hd) in rows:
        cells = f"{pp:.0f} | {hp:.0f} | {pp / hp:.2f} | {pd:.0f} | {hd:.0f} | {pd / hd:.2f}"
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
