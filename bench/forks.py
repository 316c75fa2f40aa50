"""n > 1 as copy-on-write forks against independent children, side by side in one run.

    python bench/forks.py [--model DIR] [--n 8] [--prompt-tokens 1000] [--max-tokens 32]
                          [--caching on,off] [--rounds 1]

One prompt of --prompt-tokens random tokens, sampled n ways (temperature 0.8, seed 0: every
mode should sample the same tokens), on an LLMEngine per mode: "independent" (n engine requests
that share full prompt blocks only through the prefix cache, fork_parallel_samples=False)
and "forks" (the prompt is prefilled once; the children share every prompt block, the partly
filled last one until its first write copies it). Reported per mode, with prefix caching on and
off: the most KV blocks held at once, prompt tokens computed, block copies, wall time and output
tokens per second, and the forks/independent ratios. Samples equal across modes are counted.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.forks import sample_params
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@dataclass
class RunResult:
    peak_blocks: int = 0
    prefill_tokens: int = 0
    copies: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    samples: tuple = ()


def run(engine: LLMEngine, prompt: list[int], args, tag: str) -> RunResult:
    """Submits the n samples of the prompt at once and steps to completion."""
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.reset_prefix_cache(), "engine is not idle"
    params = SamplingParams(
        n=args.n, temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True
    )
    reqs = [
        engine.make_request(f"{tag}-{i}", prompt, sample_params(params, i)) for i in range(args.n)
    ]
    for req in reqs[1:]:
        req.fork_parent_id = reqs[0].request_id
    result = RunResult()
    copies_before = kv.num_cow_copies_total
    t0 = time.monotonic()
    for req in reqs:
        engine.add(req)
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        result.peak_blocks = max(result.peak_blocks, stats.num_total_blocks - stats.num_free_blocks)
        result.prefill_tokens += stats.num_prompt_tokens
        result.output_tokens += stats.num_generation_tokens
    result.wall_s = time.monotonic() - t0
    result.copies = kv.num_cow_copies_total - copies_before
    result.samples = tuple(tuple(r.output_token_ids) for r in reqs)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks, "blocks leaked"
    return result


def build_engine(args, forks: bool, caching: bool) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            enable_prefix_caching=caching,
            fork_parallel_samples=forks,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    warmup = argparse.Namespace(n=2, max_tokens=2)
    run(engine, list(range(100, 164)), warmup, "warmup")  # first-call costs out of the timing
    return engine


def report(args, results: dict[tuple[str, str], list[RunResult]]) -> None:
    print(
        f"\nn={args.n}, {args.prompt_tokens}-token prompt, {args.max_tokens} output tokens per "
        f"sample, {args.rounds} round(s); medians over rounds"
    )
    print(
        f"{'caching':8} {'mode':12} {'peak blocks':>11} {'prefill tok':>11} {'copies':>7} "
        f"{'wall s':>7} {'out tok/s':>9}"
    )
    rows = {}
    for (caching, mode), runs in results.items():
        r = sorted(runs, key=lambda x: x.wall_s)[len(runs) // 2]
        rows[caching, mode] = r
        print(
            f"{caching:8} {mode:12} {r.peak_blocks:11d} {r.prefill_tokens:11d} {r.copies:7d} "
            f"{r.wall_s:7.2f} {r.output_tokens / r.wall_s:9.1f}"
        )
    for caching in args.caching:
        ind, fk = rows[caching, "independent"], rows[caching, "forks"]
        print(
            f"forks/independent, prefix caching {caching}: peak blocks "
            f"x{fk.peak_blocks / ind.peak_blocks:.3f}, prefill tokens "
            f"x{fk.prefill_tokens / ind.prefill_tokens:.3f}, tokens/s "
            f"x{(fk.output_tokens / fk.wall_s) / (ind.output_tokens / ind.wall_s):.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--caching", default="on,off", help="prefix caching modes, comma separated")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    args.caching = args.caching.split(",")
    results: dict[tuple[str, str], list[RunResult]] = {}
    for caching in args.caching:
        engines = {
            mode: build_engine(args, mode == "forks", caching == "on")
            for mode in ("independent", "forks")
        }
        vocab = engines["forks"].vocab_size
        for r in range(args.rounds):
            rng = random.Random(r)
            prompt = [rng.randrange(100, min(vocab, 40000)) for _ in range(args.prompt_tokens)]
            for mode, engine in engines.items():  # alternating: drift hits both alike
                res = run(engine, prompt, args, f"{mode}{r}")
                results.setdefault((caching, mode), []).append(res)
                print(f"caching {caching} round {r} {mode}: {res.wall_s:.1f} s", flush=True)
            ind, fk = (results[caching, m][-1].samples for m in ("independent", "forks"))
            same = sum(a == b for a, b in zip(ind, fk))
            print(f"samples equal across modes: {same}/{args.n}", flush=True)
        for engine in engines.values():
            engine.shutdown()
    report(args, results)


if __name__ == "__main__":
    main()
