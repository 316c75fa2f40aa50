"""bench/lora.py --vllm: pagedserve against vLLM's CPU build serving the same LoRA adapters on
the same model, side by side from one run.

Both engines take the same float32 SmolLM2 folder (the one pagedserve makes from the packaged
GGUF) in --dtype, the same random adapter folders (rank 16 on all seven targets), the same
prompts (token ids), c requests at once, adapters round robin, --max-loras 4, greedy with
ignore_eos. Per row, after a warm-up round of the same adapters: a round of max_tokens 1 and a
round of max_tokens N on fresh prompts (no prefix hits); decode tokens/s is c * (N - 1) over
the difference of the two walls (prefill cancels out), output tokens/s is c * N over the second.
vLLM runs in its own venv (bench/.venv-vllm, offline LLM with enable_lora, LoRARequest per
prompt); its worker binds its own cores (the usable ones less one): run pagedserve with the same
OMP_NUM_THREADS for a fair row.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

VLLM_TIMEOUT_S = 900
VLLM_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enable_lora=True, max_loras=cfg["max_loras"],
          max_lora_rank=cfg["rank"], max_cpu_loras=cfg["max_loras"], max_model_len=512,
          max_num_seqs=cfg["c"], enable_prefix_caching=True)
paths = cfg["adapters"]
def wall(prompts, n, max_tokens):
    loras = [LoRARequest(f"a{i % n}", 1 + i % n, paths[i % n]) if n else None
             for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return time.perf_counter() - t
rows = {}
for n in cfg["rows"]:
    warm, short, long = cfg["prompts"][str(n)]
    wall(warm, n, 4)
    rows[n] = [wall(short, n, 1), wall(long, n, cfg["max_tokens"])]
print("VLLM_RESULT " + json.dumps(rows))
"""


def run_vllm(venv: Path, cfg: dict) -> dict | str:
    """{adapters: (wall of max_tokens 1, wall of max_tokens N)}, or why vLLM gave none."""
    python = venv.absolute() / "bin" / "python"
    if not python.exists():
        return f"{venv} has no python"
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
            return {int(k): tuple(v) for k, v in out.items()}
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return (lines or [f"exit {proc.returncode}"])[-1][:300]


def run_ours(cfg: dict) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    mods = tuple(f"a{i}={p}" for i, p in enumerate(cfg["adapters"]))
    engine = LLMEngine(
        EngineConfig(
            model=cfg["model"], dtype=cfg["dtype"], max_num_seqs=cfg["c"], enable_lora=True,
            lora_modules=mods, max_loras=cfg["max_loras"], max_lora_rank=cfg["rank"],
            max_cpu_loras=cfg["max_loras"], max_model_len=512,
        )
    )  # fmt: skip

    def wall(prompts, n, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            name = f"a{i % n}" if n else None
            engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, lora_name=name)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    rows = {}
    for n in cfg["rows"]:
        warm, short, long = cfg["prompts"][str(n)]
        wall(warm, n, 4)
        rows[n] = (wall(short, n, 1), wall(long, n, cfg["max_tokens"]))
    return rows


def compare(model: str, adapters: list[Path], args, rng) -> None:
    """Prints the side-by-side table (markdown) for c = args.concurrency[0]."""
    c, n_tok = args.concurrency[0], args.max_tokens
    rows = [0, 1, 4]

    def prompts(k):
        return [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(k)]

    cfg = {
        "model": model, "dtype": args.dtype, "adapters": [str(p) for p in adapters[:4]],
        "rank": args.rank, "max_loras": 4, "c": c, "max_tokens": n_tok, "rows": rows,
        "prompts": {str(n): [prompts(c), prompts(c), prompts(c)] for n in rows},
    }  # fmt: skip
    results = {"pagedserve": run_ours(cfg)}
    vllm = run_vllm(args.vllm_venv, cfg)
    if isinstance(vllm, str):
        print(f"vLLM CPU: no result: {vllm}")
    else:
        results["vLLM CPU"] = vllm
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"c={c}, prompt {args.prompt_len}, max_tokens {n_tok}, {args.dtype}, "
          f"rank {args.rank}, OMP_NUM_THREADS={threads}")  # fmt: skip
    print("| adapters | engine | decode tok/s | x pagedserve | out tok/s | x pagedserve |")
    print("|---|---|---:|---:|---:|---:|")
    for n in rows:
        ours = None
        for name, res in results.items():
            short, long = res[n]
            decode, out = c * (n_tok - 1) / max(long - short, 1e-9), c * n_tok / long
            ours = ours or (decode, out)
            print(f"| {n or 'base'} | {name} | {decode:.1f} | {decode / ours[0]:.2f} | "
                  f"{out:.1f} | {out / ours[1]:.2f} |")  # fmt: skip
