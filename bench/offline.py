"""In-process throughput of the engine (no HTTP), split into prefill and decode steps.

    python bench/offline.py [--workload std|prefix] [--num-requests 64] [--dtype bfloat16]

std: 256 random prompt tokens -> 128 tokens; prefix: a shared 512-token prefix + 128 random
tokens -> 64 tokens. Greedy, ignore_eos, at most 32 running (the peers workloads without the
server). Prints output tokens/s and the mean time of prefill/mixed steps and of decode steps.
"""

from __future__ import annotations

import argparse
import random
import time

import engine.runner.model_runner as model_runner
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def prompts_for(workload: str, n: int, seed: int = 0) -> tuple[list[list[int]], int]:
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(k)]

    if workload == "prefix":
        shared = ids(512)
        return [shared + ids(128) for _ in range(n)], 64
    return [ids(256) for _ in range(n)], 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", choices=("std", "prefix"), default="std")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    llm = LLM(None, dtype=args.dtype, max_model_len=2048, max_num_seqs=32)
    prompts, max_tokens = prompts_for(args.workload, args.num_requests)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    steps = {"prefill/mixed": [0, 0.0], "decode": [0, 0.0]}
    execute = model_runner.ModelRunner.execute

    def timed(self, out):
        t = time.perf_counter()
        result = execute(self, out)
        kind = "decode" if sum(out.num_scheduled_tokens) == len(out.requests) else "prefill/mixed"
        steps[kind][0] += 1
        steps[kind][1] += time.perf_counter() - t
        return result

    model_runner.ModelRunner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    model_runner.ModelRunner.execute = execute
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rate = num_tokens / elapsed
    print(f"{args.workload}: {num_tokens} tokens in {elapsed:.2f} s = {rate:.1f} tok/s")
    for kind, (n, total) in steps.items():
        if n:
            print(f"  {kind}: {n} steps, {total / n * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
