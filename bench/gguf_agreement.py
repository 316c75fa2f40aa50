"""Greedy agreement between pagedserve and llama.cpp's llama-server on the same GGUF file.

For each GGUF type, three servers answer the same prompts (token ids, so no tokenizer differs),
temperature 0, with the chosen token's logprob:
    llamacpp      bench/.llamacpp/bin/llama-server (bench/install_llamacpp.sh) on the file
    default       pagedserve serve FILE --dtype bfloat16 (--gguf-weights auto: packed blocks for
                  decode-sized calls, engine/layers/quantization/gguf.py)
    dense         pagedserve serve FILE --dtype bfloat16 --gguf-weights dense (dequantized)
and the table gives, per pair, the prompts whose whole answer is equal, the mean length of the
common prefix of tokens, and the mean |logprob difference| over that prefix. Exact equality is
not expected across engines (other kernels round differently); the common prefix says how
long the answers stay together.

  python bench/make_gguf.py                     # the files, into bench/.llamacpp/models
  PYTHONPATH=. python bench/gguf_agreement.py --types Q8_0,Q4_0,Q4_K_M --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_BIN = ROOT / "bench" / ".llamacpp" / "bin" / "llama-server"
MODELS = ROOT / "bench" / ".llamacpp" / "models"

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, in a small village by the sea,",
    "List three uses of a paperclip:",
    "Translate to French: The weather is nice today.",
    "def quicksort(xs):",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:",
    "A haiku about autumn leaves:",
    "In 1969, the first humans",
    "The main difference between TCP and UDP is",
    "Dear hiring manager, I am writing to apply for",
]


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(port: int, proc: subprocess.Popen, limit_s: float = 900.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready after {limit_s:.0f} s")


def answers(cmd: list[str], port: int, prompts: list[list[int]], max_tokens: int, log: Path):
    """[(token strings, logprobs)] per prompt from one server started with cmd."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        _wait_ready(port, proc)
        result = []
        for ids in prompts:
            body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens,
                    "temperature": 0, "logprobs": 1}
            choice = _post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]
            result.append(_tokens(choice["logprobs"]))
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _tokens(lp: dict) -> tuple[list[str], list[float]]:
    if "content" in lp:  # llama-server: the chat-completions shape in completions
        return [t["token"] for t in lp["content"]], [t["logprob"] for t in lp["content"]]
    return lp["tokens"], lp["token_logprobs"]  # OpenAI's completions shape


def compare(a, b) -> dict:
    equal, prefix, diffs = 0, [], []
    for (ta, la), (tb, lb) in zip(a, b):
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        equal += ta == tb
        prefix.append(n)
        diffs += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return {
        "equal": equal,
        "prompts": len(a),
        "mean_prefix": sum(prefix) / len(prefix),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=18970)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gguf_agreement"))
    args = ap.parse_args()
    if not LLAMACPP_BIN.exists():
        sys.exit(f"{LLAMACPP_BIN} is missing: bash bench/install_llamacpp.sh")
    from transformers import AutoTokenizer

    from engine.model_loader.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    args.out.mkdir(parents=True, exist_ok=True)
    py, port, threads = sys.executable, str(args.port), str(os.cpu_count() or 1)
    rows = []
    print(f"greedy agreement, {len(PROMPTS)} prompts x {args.max_tokens} tokens, "
          f"{args.model_name}")
    print("| GGUF | pair | whole answer equal | mean common prefix (tokens) "
          "| mean abs logprob diff |")
    print("|---|---|---|---|---|", flush=True)
    for qtype in args.types.split(","):
        gguf = MODELS / f"{args.model_name}.{qtype}.gguf"
        if not gguf.exists():
            print(f"SKIP {qtype}: {gguf} is missing (python bench/make_gguf.py)")
            continue
        serve = [py, "-m", "server.cli", "serve", str(gguf), "--served-model-name", "bench",
                 "--dtype", "bfloat16", "--max-model-len", "2048", "--port", port,
                 "--log-level", "warning"]
        cmds = {
            "llamacpp": [str(LLAMACPP_BIN), "-m", str(gguf), "--alias", "bench", "--host",
                         "127.0.0.1", "--port", port, "-np", "1", "-c", "2048", "-t", threads,
                         "--no-webui"],
            "default": serve,
            "dense": [*serve, "--gguf-weights", "dense"],
        }
        got = {}
        for name, cmd in cmds.items():
            log = args.out / f"{qtype}-{name}.log"
            got[name] = answers(cmd, args.port, prompts, args.max_tokens, log)
            print(f"{qtype} {name}: done", file=sys.stderr, flush=True)
        pairs = (("default", "llamacpp"), ("dense", "llamacpp"), ("default", "dense"))
        for a, b in pairs:  # printed as each type finishes: a long run keeps what it measured
            r = {"type": qtype, "pair": f"{a} vs {b}", **compare(got[a], got[b])}
            rows.append(r)
            print(f"| {r['type']} | {r['pair']} | {r['equal']}/{r['prompts']} | "
                  f"{r['mean_prefix']:.1f} | {r['mean_abs_logprob_diff']:.3f} |", flush=True)
        (args.out / "agreement.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
