"""Sampler cost per step by parameter mix, as a ratio to plain greedy argmax, measured side by side.

python bench/micro/sampler.py [--rows 256] [--vocab 49152] [--device cpu|cuda] [--iters 20]
"""

from __future__ import annotations

import argparse
import random

import torch
from harness import measure, ratio_table

from engine.core.request import Request
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams

MIXES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k+top_p+min_p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "seeded (all rows)": dict(temperature=0.8, seed=1),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.1),
    "greedy+logprobs=5": dict(temperature=0.0, logprobs=5),
}


def _requests(n: int, vocab: int, params: dict) -> list[Request]:
    rng = random.Random(0)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(512)]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=1024, **params))
        for _ in range(128):
            req.all_token_ids.append(rng.randrange(vocab))
        reqs.append(req)
    return reqs


def _time(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], iters: int) -> float:
    # one warm-up call (and generator / prompt-mask creation); each call ends in .tolist()
    sync = torch.cuda.synchronize if logits.is_cuda else None
    return measure(lambda: sampler(logits, reqs), 1, reps=iters, sync=sync)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device(args.device)
    logits = torch.randn(args.rows, args.vocab, device=dev) * 4
    print(f"{args.rows} rows x {args.vocab} vocab on {dev}, {args.iters} iterations each")
    rows = [
        (name, _time(Sampler(dev), logits, _requests(args.rows, args.vocab, params), args.iters))
        for name, params in MIXES.items()
    ]
    ratio_table(rows, unit="ms/step", ratio="x greedy")


if __name__ == "__main__":
    main()
