"""Batch invariance in bf16: does a request's greedy answer depend on what else runs in its step?

The default model (SmolLM2-135M-Instruct) in bfloat16 through the offline engine: NUM_PROMPTS
different prompts, greedy MAX_TOKENS tokens each, run

- alone: one prompt per generate() call (every step holds that request only);
- batched: all prompts in one generate() call (prefill and decode steps of many rows);
- chunked: all prompts at once under a token budget below the prompt lengths, so prefill is
  split into chunks that start and end elsewhere and mix with other requests' decode rows;

and prints how many prompts give the alone tokens batched and chunked (vLLM's check, issue 22:
12 of 12 is the target), with the kernels' batch-invariant mode off and on
(pagedserve_kernels.cpu_ops.batch_invariant, `pagedserve serve --batch-invariant`), and the output
tokens/s of the alone runs (one request: decode speed) and of the batched run: the cost of the mode.

    python bench/batch_invariance.py [--max-tokens 64] [--modes off,on] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import time

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
    "List three fruits that are red:",
    "Once upon a time, in a small village at the edge of a forest, there lived",
    "Translate to French: I would like a cup of coffee, please.",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:",
    "A good way to learn a new programming language is",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "import numpy as np\n\n# compute the mean of each column of a matrix\n",
]


def run(model, prompts, max_tokens: int, dtype: str, alone: bool, **engine_args):
    """(token ids per prompt, seconds of generation) for one engine built with engine_args."""
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if alone:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outs], took


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check(args, invariant: bool) -> None:
    from pagedserve_kernels.cpu_ops import BATCH_INVARIANT_ENV

    os.environ[BATCH_INVARIANT_ENV[0]] = "1" if invariant else "0"  # read as the model loads
    os.environ.pop(BATCH_INVARIANT_ENV[1], None)
    n, m = args.max_tokens, args.model
    alone, t_alone = run(m, PROMPTS, n, args.dtype, alone=True)
    batched, t_batched = run(m, PROMPTS, n, args.dtype, alone=False)
    chunked, _ = run(m, PROMPTS, n, args.dtype, alone=False, max_num_batched_tokens=args.chunk)
    print(f"batch-invariant {'on' if invariant else 'off'}: {args.dtype}, greedy {n} tokens")
    for name, other in (("batched", batched), ("chunked", chunked)):
        same = sum(a == b for a, b in zip(alone, other))
        diffs = [first_difference(a, b) for a, b in zip(alone, other)]
        where = ", ".join(f"#{i}@{d}" for i, d in enumerate(diffs) if d is not None) or "none"
        print(f"  alone == {name}: {same} of {len(PROMPTS)} (first differing token: {where})")
    total = len(PROMPTS) * n
    print(f"  output tok/s: alone {total / t_alone:.1f}, batched {total / t_batched:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=24, help="token budget of the chunked run")
    parser.add_argument("--modes", default="off,on", help="batch-invariant modes to run")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        check(args, invariant=mode == "on")


if __name__ == "__main__":
    main()
