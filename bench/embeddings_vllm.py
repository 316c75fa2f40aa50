"""The vLLM peer of bench/embeddings.py, run under vLLM's own interpreter (its CPU build lives
in bench/.venv-vllm): embeddings/s of LLM.embed on the same token ids, one JSON line per cell,
plus one line with its vectors of two texts (for bench/embeddings.py to check them against
sentence-transformers).

    python bench/embeddings_vllm.py MODEL_DIR IDS_JSON [--repeats 2] [--check TEXTS_JSON]

IDS_JSON holds [[tokens, batch, [token ids per input]], ...]: the cells, their exact inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("ids_json")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check", default="[]", help="JSON list of texts to embed once, for a check")
    args = ap.parse_args()
    # MiniLM's sentence_bert_config says 256; BERT's absolute positions go to 512, as the
    # sentence-transformers side of the benchmark is raised to
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    from vllm import LLM, TokensPrompt

    # the CPU backend reserves gpu_memory_utilization of the host's memory (shared here) and
    # one core for its scheduler unless told otherwise: every core computes, as ours do
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    llm = LLM(
        model=args.model_dir,
        runner="pooling",
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.1,
    )
    texts = json.loads(args.check)
    if texts:
        vecs = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        print(json.dumps({"check": vecs}), flush=True)
    with open(args.ids_json) as f:
        cells = json.load(f)
    for size, batch, ids in cells:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        llm.embed(prompts[:1], use_tqdm=False)  # warm the shape
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.embed(prompts, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        print(json.dumps({"tokens": size, "batch": batch, "per_s": batch / best}), flush=True)


if __name__ == "__main__":
    main()
