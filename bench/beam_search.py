"""Beam search (width 4) on the default SmolLM2: pagedserve's forks against vLLM's CPU build
(LLM.beam_search) and transformers' generate(num_beams=...), on the same float32 weights and
prompts, in one run.

    PYTHONPATH=. python bench/beam_search.py [--width 4] [--max-tokens 32] [--prompts 4]
                                             [--vllm-venv bench/.venv-vllm] [--no-vllm]
                                             [--threads N]

All three load the dequantized float32 folder pagedserve makes from the packaged GGUF
(~/.cache/pagedserve/SmolLM2-135M-Instruct). Each engine gets the prompts at once (token ids),
width 4, length_penalty 1, EOS honoured. Reported: wall seconds (after a warm-up), returned
tokens per second (every sequence's tokens / wall time), and how many prompts' width sequences
equal transformers' (ids and order), and how many single sequences do.

All three run with the same number of compute threads (OMP_NUM_THREADS, set before torch loads):
by default the number vLLM's CPU worker takes, the usable cores less one (it keeps a core for
its scheduler process). On a shared machine this matters more than anything in the engines: two
OpenMP threads on two busy cores made every float32 matmul ~10x slower than one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_TIMEOUT_S = 600
TEXTS = [
    "The history of the printing press begins",
    "Here is a short recipe for bread:",
    "Photosynthesis is the process by which",
    "The three largest cities in Europe are",
    "A good way to learn a new language is",
    "Once upon a time, in a small village,",
]

VLLM_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
from vllm import LLM
from vllm.sampling_params import BeamSearchParams
llm = LLM(model=cfg["model"], dtype="float32", max_model_len=1024, enable_prefix_caching=True)
params = BeamSearchParams(beam_width=cfg["width"], max_tokens=cfg["max_tokens"])
prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
llm.beam_search(prompts[:1], BeamSearchParams(beam_width=cfg["width"], max_tokens=2))
t = time.perf_counter()
outs = llm.beam_search(prompts, params)
wall = time.perf_counter() - t
seqs = [[s.tokens[len(p["prompt_token_ids"]):] for s in o.sequences] for o, p in zip(outs, prompts)]
print("VLLM_RESULT " + json.dumps({"wall": wall, "seqs": seqs}))
"""


def run_ours(model: str, prompts: list[list[int]], args) -> tuple[float, list]:
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=1024)
    params = SamplingParams(n=args.width, use_beam_search=True, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(n=args.width, use_beam_search=True, max_tokens=2))
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    return wall, [[list(c.token_ids) for c in o.outputs] for o in outs]


def run_transformers(model: str, prompts: list[list[int]], args) -> tuple[float, list]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    results, t = [], time.perf_counter()
    for ids in prompts:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                num_beams=args.width, num_return_sequences=args.width, do_sample=False,
                max_new_tokens=args.max_tokens, length_penalty=1.0, early_stopping=False,
            )  # fmt: skip
        rows = []
        for row in out[:, len(ids) :].tolist():
            end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
            rows.append(row[:end])
        results.append(rows)
    return time.perf_counter() - t, results


def run_vllm(venv: Path, model: str, prompts: list[list[int]], args) -> tuple[float, list] | str:
    python = venv.absolute() / "bin" / "python"
    if not python.exists():
        return f"{venv} has no python"
    cfg = {"model": model, "prompts": prompts, "width": args.width, "max_tokens": args.max_tokens}
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run(
            [str(python), "-c", VLLM_SCRIPT, json.dumps(cfg)], capture_output=True, text=True,
            timeout=VLLM_TIMEOUT_S, env=env, cwd="/tmp",
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"no result within {VLLM_TIMEOUT_S} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("VLLM_RESULT "):
            out = json.loads(line.removeprefix("VLLM_RESULT "))
            return out["wall"], out["seqs"]
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return (lines or [f"exit {proc.returncode}"])[-1][:300]


def agreement(seqs: list, ref: list) -> tuple[int, int, int]:
    """(prompts whose sequences all equal, in order; single sequences equal; total)."""
    whole = sum(a == b for a, b in zip(seqs, ref))
    single = sum(x == y for a, b in zip(seqs, ref) for x, y in zip(a, b))
    return whole, single, sum(len(b) for b in ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / "bench" / ".venv-vllm")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) - 1),
        help="compute threads for every engine (default: vLLM's, the cores less one)",
    )
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads; inherited by vLLM

    from engine import LLM

    model = str(LLM(max_model_len=256).engine.model_dir)  # the packaged GGUF's float32 folder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(t) for t in TEXTS[: args.prompts]]
    results = {"pagedserve": run_ours(model, prompts, args)}
    results["transformers"] = run_transformers(model, prompts, args)
    note = "not run (--no-vllm)"
    if not args.no_vllm:
        out = run_vllm(args.vllm_venv, model, prompts, args)
        if isinstance(out, str):
            note = f"failed: {out}"
        else:
            results["vLLM CPU"], note = out, "ran"
    ref = results["transformers"][1]
    ours_rate = None
    print(
        f"beam search width {args.width}, {len(prompts)} prompts, max_tokens {args.max_tokens}, "
        f"{args.threads} thread(s)"
    )
    print("| engine | wall s | tokens/s | vs pagedserve | prompts equal to HF | seqs equal |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (wall, seqs) in results.items():
        rate = sum(len(s) for group in seqs for s in group) / wall
        ours_rate = ours_rate or rate
        whole, single, total = agreement(seqs, ref)
        print(f"| {name} | {wall:.1f} | {rate:.1f} | {rate / ours_rate:.2f} | "
              f"{whole}/{len(prompts)} | {single}/{total} |")  # fmt: skip
    print(f"vLLM: {note}", file=sys.stderr)


if __name__ == "__main__":
    main()
