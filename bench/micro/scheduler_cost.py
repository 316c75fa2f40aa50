"""The scheduler's own cost per step, and its share of a real engine step.

1. Null model runner: schedule() + update_from_output() at 32, 256 and 1024 running requests in
   decode steady state with prefix caching on (block_size 16, so a block fills and is hashed
   every 16 steps per request; that cost is inside the average).
2. Real engine: LLMEngine.step() on the default model at 32 running requests, with the time
   spent inside schedule() and update_from_output() measured in the same steps.

Part 1 counts this thread's CPU time (time.thread_time), so other processes on a shared machine
inflate it less; part 2 is wall time for both the step and the scheduler's share of it.

Usage: python bench/micro/scheduler_cost.py [--sizes 32 256 1024] [--steps 200] [--no-real]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from harness import CLOCKS

from engine.config import EngineConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams

PROMPT_LEN = 64
BLOCK_SIZE = 16


def null_runner(out) -> ModelRunnerOutput:
    """Samples token 7 wherever a request reached its newest token; no model at all."""
    return ModelRunnerOutput(
        [
            7 if c + n == len(r.all_token_ids) else None
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ]
    )


def decode_scheduler(num_running: int, num_steps: int) -> Scheduler:
    """A scheduler with num_running requests admitted and prefilled, room for num_steps more."""
    # Early admissions decode while later ones still prefill: leave room for both phases.
    max_tokens = num_steps + num_running // 8 + 64
    max_model_len = BLOCK_SIZE + PROMPT_LEN + max_tokens
    cfg = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(2048, num_running),
        max_model_len=max_model_len,
        enable_prefix_caching=True,
    )
    num_blocks = num_running * cdiv(max_model_len, BLOCK_SIZE) + 16
    sched = Scheduler(cfg, num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        # A shared first block (a system prompt) then distinct tokens: prefix hits stay real.
        prompt = list(range(BLOCK_SIZE)) + [1000 + i * PROMPT_LEN + j for j in range(PROMPT_LEN)]
        sched.add_request(Request(str(i), prompt, params))
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, null_runner(out))
    return sched


def time_null_steps(num_running: int, num_steps: int) -> dict[str, float]:
    sched = decode_scheduler(num_running, num_steps)
    clock = CLOCKS["thread"]
    sched_ms, update_ms = [], []
    for _ in range(num_steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        sampled = null_runner(out)
        t2 = clock()
        sched.update_from_output(out, sampled)
        t3 = clock()
        assert len(out.requests) == num_running and not out.preempted
        sched_ms.append((t1 - t0) * 1e3)
        update_ms.append((t3 - t2) * 1e3)
    total = [a + b for a, b in zip(sched_ms, update_ms)]
    return {
        "schedule": statistics.mean(sched_ms),
        "update": statistics.mean(update_ms),
        "mean": statistics.mean(total),
        "median": statistics.median(total),
        "p90": statistics.quantiles(total, n=10)[-1],
    }


def time_real_steps(num_running: int, num_steps: int) -> dict[str, float]:
    """LLMEngine.step() on the default model; the scheduler's calls are timed inside it."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=None, max_num_seqs=num_running))
    sched = engine.scheduler
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    sched.schedule = timed(sched.schedule)
    sched.update_from_output = timed(sched.update_from_output)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 64, ignore_eos=True)
    tok = engine.tokenizer
    for i in range(num_running):
        ids = tok.encode(f"Request {i}: write a long story about the number {i}.")
        engine.add_request(str(i), ids, params)
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        engine.step()  # prefill
    step_s, sched_s = [], []
    for _ in range(num_steps):
        spent[0] = 0.0
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        sched_s.append(spent[0])
    return {
        "device": str(engine.runner.device),
        "step_ms": statistics.median(step_s) * 1e3,
        "sched_ms": statistics.median(sched_s) * 1e3,
        "share": sum(sched_s) / sum(step_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--real-running", type=int, default=32)
    ap.add_argument("--real-steps", type=int, default=20)
    ap.add_argument("--no-real", action="store_true")
    args = ap.parse_args()

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("scheduler CPU ms per step, null model runner, decode steady state, prefix caching on")
    print(
        f"{'running':>8} {'schedule ms':>12} {'update ms':>10} {'mean ms':>8} "
        f"{'median ms':>10} {'p90 ms':>7} {'us/request':>11}"
    )
    for n in args.sizes:
        r = time_null_steps(n, args.steps)
        print(
            f"{n:>8} {r['schedule']:>12.3f} {r['update']:>10.3f} {r['mean']:>8.3f} "
            f"{r['median']:>10.3f} {r['p90']:>7.3f} {r['mean'] * 1e3 / n:>11.2f}"
        )
    if args.no_real:
        return
    r = time_real_steps(args.real_running, args.real_steps)
    print(f"\nreal LLMEngine.step(), default model, {args.real_running} running, {r['device']}")
    print(f"{'step ms':>8} {'scheduler ms':>13} {'scheduler share':>16}")
    print(f"{r['step_ms']:>8.2f} {r['sched_ms']:>13.3f} {r['share']:>15.2%}")


if __name__ == "__main__":
    main()
