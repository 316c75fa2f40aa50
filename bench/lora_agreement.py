"""Greedy token agreement of our LoRA serving with vLLM's CPU build and with PEFT, on the same
adapters, model and prompt token ids (float32: every engine should give the same tokens).

    python bench/lora_agreement.py [--prompts 8] [--max-tokens 24] [--vllm-venv bench/.venv-vllm]

The default model's float32 folder (what pagedserve makes from the packaged GGUF), two random
rank-16 adapters on all seven targets (bench/lora.py's write_adapter), the base and each adapter
on every prompt in one batch (ours and vLLM's offline LLM with a LoRARequest per prompt); PEFT
(PeftModel on transformers, one prompt at a time) is the referee. Prints, per adapter, how many
sequences agree exactly and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora import write_adapter  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_loader.loader import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three laws of thermodynamics are", "SELECT name FROM users WHERE", "Photosynthesis is",
    "To make a cup of tea, first", "The best way to learn a new language is",
    "In 1969, the first humans", "import numpy as np\n", "My favourite recipe is",
    "The meaning of the word 'serendipity' is",
]  # fmt: skip

VLLM_SCRIPT = r"""
import json, sys
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
llm = LLM(model=cfg["model"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
          max_model_len=256, max_num_seqs=len(cfg["jobs"]), enable_prefix_caching=False)
paths = cfg["adapters"]
loras = [LoRARequest(n, 1 + sorted(paths).index(n), paths[n]) if n else None
         for _, n in cfg["jobs"]]
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p, _ in cfg["jobs"]], params,
                    lora_request=loras, use_tqdm=False)
print("VLLM_RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def ours(model: str, adapters: dict, jobs, max_tokens: int) -> list[list[int]]:
    mods = tuple(f"{n}={p}" for n, p in adapters.items())
    engine = LLMEngine(
        EngineConfig(model=model, dtype="float32", enable_lora=True, lora_modules=mods,
                     max_loras=2, max_lora_rank=16, max_model_len=256)
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, name) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, lora_name=name)
    got = {i: [] for i in range(len(jobs))}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            got[int(out.request_id)] += out.outputs[0].token_ids
    return [got[i] for i in range(len(jobs))]


def vllm(venv: Path, model: str, adapters: dict, jobs, max_tokens: int):
    cfg = {"model": model, "adapters": {n: str(p) for n, p in adapters.items()}, "jobs": jobs,
           "max_tokens": max_tokens}  # fmt: skip
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(venv.absolute() / "bin" / "python"), "-c", VLLM_SCRIPT, json.dumps(cfg)],
        capture_output=True, text=True, timeout=900, env=env, cwd="/tmp",
    )  # fmt: skip
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT "))
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return (lines or [f"exit {proc.returncode}"])[-1][:300]


def peft(model: str, adapters: dict, jobs, max_tokens: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = []
    for name in [None, *adapters]:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        if name is not None:
            m = PeftModel.from_pretrained(m, adapters[name]).eval()
        for prompt, n in jobs:
            if n == name:
                ids = torch.tensor([prompt])
                with torch.no_grad():
                    g = m.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                   min_new_tokens=max_tokens, eos_token_id=None)  # fmt: skip
                out.append((jobs.index((prompt, n)), g[0, len(prompt) :].tolist()))
    return [t for _, t in sorted(out)]


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--vllm-venv", type=Path, default=Path("bench/.venv-vllm"))
    args = p.parse_args()
    model = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(t)["input_ids"] for t in TEXTS[: args.prompts]]
    cfg = AutoConfig.from_pretrained(model)
    root = Path(tempfile.mkdtemp(prefix="lora-agree-"))
    adapters = {f"a{i}": write_adapter(root / f"a{i}", cfg, 16, 100 + i) for i in range(2)}
    jobs = [(pr, n) for n in [None, *adapters] for pr in prompts]
    results = {"ours": ours(model, adapters, jobs, args.max_tokens)}
    v = vllm(args.vllm_venv, model, adapters, jobs, args.max_tokens)
    if isinstance(v, str):
        print(f"vLLM CPU: no result: {v}")
    else:
        results["vLLM"] = v
    results["PEFT"] = peft(model, adapters, jobs, args.max_tokens)
    pairs = [(a, b) for a in results for b in results if a < b]
    print(f"{args.prompts} prompts x {args.max_tokens} greedy tokens, float32, rank 16")
    print("| adapter | changes base (PEFT) | " + " | ".join(f"{a}=={b}" for a, b in pairs) + " |")
    print("|---|---|" + "---|" * len(pairs))
    for name in [None, *adapters]:
        idx = [i for i, (_, n) in enumerate(jobs) if n == name]
        base = [results["PEFT"][i] for i, (_, n) in enumerate(jobs) if n is None]
        changed = sum(results["PEFT"][i] != b for i, b in zip(idx, base))
        cells = []
        for a, b in pairs:
            same = sum(results[a][i] == results[b][i] for i in idx)
            pre = sum(common_prefix(results[a][i], results[b][i]) for i in idx) / len(idx)
            cells.append(f"{same}/{len(idx)} (prefix {pre:.1f})")
        print(f"| {name or 'base'} | {changed}/{len(idx)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
