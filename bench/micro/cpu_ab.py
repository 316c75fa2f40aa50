"""A/B of one CPU fast path in one process, the two arms interleaved (the machine drifts).

    python bench/micro/cpu_ab.py --feature cascade --workload prefix --rounds 4
    python bench/micro/cpu_ab.py --feature narrow-linear --workload prefill --rounds 6

cascade: decodes over a shared prefix through paged_attention_cascade
(pagedserve_kernels/cpu_backend.py, CASCADE_MIN_TOKENS), against the one-pass decode kernel.
narrow-linear: linears of at most AMX_NARROW_MAX_OUT outputs on the AMX kernel at every row count
(pagedserve_kernels/cpu_linear.py), against oneDNN above AMX_MAX_ROWS rows. Workloads as
bench/offline.py's, plus prefill: 32 prompts of 256 tokens, one output token each. Every run draws
fresh prompts (no prefix-cache hits across runs); each round runs both arms, in alternating order.
Prints each run's wall time and the ratio of the totals, off / on (above 1: the fast path is
faster).
"""

from __future__ import annotations

import argparse
import random
import time

from harness import interleaved

import pagedserve_kernels.cpu_backend as cpu_backend
import pagedserve_kernels.cpu_linear as cpu_linear
from engine.llm import LLM
from engine.sampling_params import SamplingParams

FEATURES = {  # feature -> (module, knob, value off); on is the module's own value
    "cascade": (cpu_backend, "CASCADE_MIN_TOKENS", 10**9),
    "narrow-linear": (cpu_linear, "AMX_NARROW_MAX_OUT", 0),
}


def workload(name: str, rng: random.Random,
             num_prompts: int | None = None) -> tuple[list[list[int]], SamplingParams, int]:
    def ids(k: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(k)]

    if name == "prefix":
        shared = ids(512)
        prompts, out = [shared + ids(128) for _ in range(num_prompts or 64)], 64
    elif name == "std":
        prompts, out = [ids(256) for _ in range(num_prompts or 64)], 128
    else:  # prefill
        prompts, out = [ids(256) for _ in range(num_prompts or 32)], 1
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    return prompts, params, len(prompts) * out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--feature", choices=sorted(FEATURES), required=True)
    p.add_argument("--workload", choices=("std", "prefix", "prefill"), default="prefix")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int,
                   help="prompts per run (default: 64 for std and prefix, 32 for prefill)")
    args = p.parse_args()

    module, knob, off_value = FEATURES[args.feature]
    arms = {"off": off_value, "on": getattr(module, knob)}  # off first in even rounds
    llm = LLM(None, dtype="bfloat16", max_model_len=2048, max_num_seqs=32)
    rng = random.Random(args.seed)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([[rng.randrange(100, 40000) for _ in range(16)]], warm, use_tqdm=False)
    total = {"on": 0.0, "off": 0.0}
    for r, arm, value in interleaved(arms, args.rounds):
        setattr(module, knob, value)
        prompts, params, n_out = workload(args.workload, rng, args.num_prompts)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        total[arm] += dt
        n_in = sum(len(x) for x in prompts)
        rates = f"{n_in / dt:6.0f} prompt tok/s, {n_out / dt:6.1f} out tok/s"
        print(f"round {r} {arm:3s}: {dt:6.2f} s, {rates}", flush=True)
    setattr(module, knob, arms["on"])
    print(
        f"{args.feature} on {args.workload}: off {total['off']:.2f} s, on {total['on']:.2f} s, "
        f"off / on = {total['off'] / total['on']:.3f}"
    )


if __name__ == "__main__":
    main()
