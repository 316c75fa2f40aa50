"""Prefix caching on vs off, side by side in one run: a shared system prompt across requests.

    python bench/prefix_cache.py [--model DIR] [--num-requests 64] [--shared-tokens 512]
                                 [--suffix-tokens 32] [--max-tokens 4] [--rounds 1]

Every request is the same `--shared-tokens` prefix plus its own random suffix, all submitted at
once to an LLMEngine. Reported per mode: prefix hit rate (hit tokens / looked-up tokens, from the
engine's per-step stats) against the ideal shared / prompt tokens, prompt tokens actually
computed (prefill work), median time to first token and the wall time. With --rounds > 1 the
modes alternate (off, on, off, on, ...) so drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@dataclass
class RunResult:
    num_queries: int = 0
    num_hits: int = 0
    num_prefill_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def make_prompts(args, seed: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), min(40000, vocab_size)  # clear of special tokens
    shared = [rng.randrange(lo, hi) for _ in range(args.shared_tokens)]
    return [
        shared + [rng.randrange(lo, hi) for _ in range(args.suffix_tokens)]
        for _ in range(args.num_requests)
    ]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> RunResult:
    """Submit every prompt at once and step to completion, summing the engine's stats."""
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.reset_prefix_cache(), "engine is not idle"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    result = RunResult()
    t0 = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        result.num_queries += stats.prefix_cache_queries
        result.num_hits += stats.prefix_cache_hits
        result.num_prefill_tokens += stats.num_prompt_tokens
        result.ttfts += [m.time_to_first_token for m in stats.finished]
    result.wall_s = time.monotonic() - t0
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks, "blocks leaked"
    return result


def build_engine(args, caching: bool) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
    )
    engine = LLMEngine(config)
    warmup = make_prompts(
        argparse.Namespace(shared_tokens=0, suffix_tokens=64, num_requests=1),
        seed=-1,
        vocab_size=engine.vocab_size,
    )  # first-call costs (allocator, kernels) out of the timing
    run(engine, warmup, 2, "warmup")
    return engine


def report(args, results: dict[str, list[RunResult]]) -> None:
    num_prompt = args.shared_tokens + args.suffix_tokens
    ideal = args.shared_tokens / num_prompt
    reachable = ideal * (args.num_requests - 1) / args.num_requests  # the first one must miss
    print(
        f"\n{args.num_requests} requests x ({args.shared_tokens} shared + {args.suffix_tokens} "
        f"own) prompt tokens, {args.max_tokens} output tokens each, {args.rounds} round(s)"
    )
    print(
        f"ideal hit rate shared/prompt = {ideal:.3f}; with the first request missing "
        f"= {reachable:.3f}"
    )
    header = f"{'prefix caching':15} {'hit rate':>9} {'prefill tok':>12} {'median TTFT s':>14}"
    print(header + f" {'wall s':>8}")
    medians = {}
    for mode, runs in results.items():
        queries = sum(r.num_queries for r in runs)
        hit_rate = sum(r.num_hits for r in runs) / queries if queries else 0.0
        prefill = sum(r.num_prefill_tokens for r in runs) / len(runs)
        ttft = statistics.median(t for r in runs for t in r.ttfts)
        wall = sum(r.wall_s for r in runs) / len(runs)
        medians[mode] = (prefill, ttft, wall)
        print(f"{mode:15} {hit_rate:9.3f} {prefill:12.0f} {ttft:14.3f} {wall:8.2f}")
    (p_off, t_off, w_off), (p_on, t_on, w_on) = medians["off"], medians["on"]
    print(
        f"on/off: prefill tokens x{p_on / p_off:.3f}, median TTFT x{t_on / t_off:.3f}, "
        f"wall x{w_on / w_off:.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--shared-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    engines = {"off": build_engine(args, False), "on": build_engine(args, True)}
    results: dict[str, list[RunResult]] = {"off": [], "on": []}
    for r in range(args.rounds):
        prompts = make_prompts(args, seed=r, vocab_size=engines["on"].vocab_size)
        for mode, engine in engines.items():
            results[mode].append(run(engine, prompts, args.max_tokens, f"{mode}{r}"))
            print(f"round {r} prefix caching {mode}: {results[mode][-1].wall_s:.1f} s", flush=True)
    report(args, results)


if __name__ == "__main__":
    main()
