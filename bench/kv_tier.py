"""The second KV tier against recompute only, on a multi-turn chat / RAG workload whose prefix
working set is about --pool-ratio (4) times the KV pool, side by side in one run.

    python bench/kv_tier.py [--model DIR] [--users 4] [--context-tokens 256] [--rounds 3]
                            [--turn-tokens 24] [--max-tokens 8] [--pool-ratio 4]
    python bench/kv_tier.py --workload preempt --context-tokens 48 --preempt-tokens 64
    python bench/kv_tier.py --workload swap-cost   # the swap rule's measurement (kv_swap_cost.py)

Each user has a document of --context-tokens random tokens (a RAG context or a long system
prompt); every round each user in turn asks a new question of --turn-tokens tokens, appended to
its conversation so far (the previous answers included), and waits for --max-tokens greedy
tokens. The pool holds a quarter of the users' contexts, so by the time a user comes back its
prefix was evicted: "recompute" computes it again, "tier disk" loads it back from the disk tier
(--kv-offloading-size, a fresh folder), "tier cpu" from the host-memory tier (--backends).
Reported per mode: TTFT p50/p90 over rounds 2.. (round 1 is cold in all), prompt tokens
computed, tier hits, bytes each way, wall time and requests/s, with tier/recompute ratios, and
how many answers each tier agrees on with recompute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def conversations(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(100, vocab) for _ in range(args.context_tokens)] for _ in range(args.users)
    ]


def run_mode(args, tier_dir: str | None, backend: str | None = None) -> dict:
    kw = dict(kv_offloading_size=args.tier_gib, kv_offloading_dir=tier_dir) if tier_dir else {}
    if backend is not None:
        kw["kv_offloading_backend"] = backend
    probe = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_gpu_blocks_override=1))
    bs = probe.config.block_size
    vocab = min(probe.vocab_size, 30000)
    probe.shutdown()
    working_set = args.users * (
        args.context_tokens + args.rounds * (args.turn_tokens + args.max_tokens)
    )
    num_blocks = int(max(working_set // bs / args.pool_ratio, (args.context_tokens * 3 // 2) // bs))
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, num_gpu_blocks_override=num_blocks, **kw)
    )
    convs = conversations(args, vocab)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ttft: list[float] = []
    answers, prefill, n = [], 0, 0
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        for u, conv in enumerate(convs):
            conv += [rng.randrange(100, vocab) for _ in range(args.turn_tokens)]
            rid = f"r{rnd}-u{u}"
            t0 = time.monotonic()
            engine.add_request(rid, list(conv), params)
            first, out_ids = None, []
            while engine.has_unfinished_requests():
                outputs, stats = engine.step()
                prefill += stats.num_prompt_tokens
                for o in outputs:
                    out_ids += o.outputs[0].token_ids
                    if first is None and o.outputs[0].token_ids:
                        first = time.monotonic() - t0
            if rnd:
                ttft.append(first)
            conv += out_ids
            answers.append(tuple(out_ids))
            n += 1
    wall = time.monotonic() - t_start
    kv = engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "blocks leaked"
    off = engine.kv_offload
    result = dict(
        blocks=num_blocks, working_set_blocks=working_set // bs, wall=wall, req_s=n / wall,
        p50=statistics.median(ttft), p90=statistics.quantiles(ttft, n=10)[-1], prefill=prefill,
        hits=off.tier.hit_tokens_total if off else 0,
        stored=off.store.bytes_stored_total if off else 0,
        loaded=off.store.bytes_loaded_total if off else 0, answers=answers,
    )  # fmt: skip
    engine.shutdown()
    return result


def run_preempt(args, tier_dir: str | None, swap_min_tokens: int | None = None) -> dict:
    """Benchmark (d): every user's request at once in a pool a quarter of their KV, so requests
    are preempted. "tier": recompute preemption, a victim's full blocks come back from the tier
    once evicted; "swap": a victim's blocks go to the tier at preemption and come back on resume
    (engine/core/kv_swap.py) when it computed at least swap_min_tokens tokens."""
    kw = dict(kv_offloading_size=args.tier_gib, kv_offloading_dir=tier_dir) if tier_dir else {}
    need = args.users * (args.context_tokens + args.preempt_tokens)
    cfg = EngineConfig(model=args.model, dtype=args.dtype, num_gpu_blocks_override=1)
    probe = LLMEngine(cfg)
    bs, vocab = probe.config.block_size, min(probe.vocab_size, 30000)
    probe.shutdown()
    num_blocks = max(
        need // bs // int(args.pool_ratio), (args.context_tokens + args.preempt_tokens) // bs + 2
    )
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, num_gpu_blocks_override=num_blocks, **kw)
    )
    if engine.kv_offload is not None:
        engine.scheduler.kv_swap.min_tokens = swap_min_tokens
    params = SamplingParams(temperature=0.0, max_tokens=args.preempt_tokens, ignore_eos=True)
    t0 = time.monotonic()
    for u, conv in enumerate(conversations(args, vocab)):
        engine.add_request(f"p{u}", conv, params)
    computed = gen = 0
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        computed += stats.num_scheduled_tokens
        gen += stats.num_generation_tokens
        for o in outputs:
            answers.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    wall = time.monotonic() - t0
    off = engine.kv_offload
    swap = engine.scheduler.kv_swap
    result = dict(
        blocks=num_blocks, wall=wall, tok_s=gen / wall, computed=computed,
        preemptions=engine.scheduler.num_preemptions_total,
        hits=off.tier.hit_tokens_total if off else 0,
        swapped=swap.num_swapped_out_total if swap else 0,
        swap_in=swap.in_blocks_total if swap else 0, answers=sorted(answers.items()),
    )  # fmt: skip
    engine.shutdown()
    return result


def main_preempt(args) -> None:
    from engine.core.kv_swap import SWAP_MIN_TOKENS

    print(f"{args.users} requests of {args.context_tokens} + {args.preempt_tokens} tokens at "
          f"once; swap when >= {args.swap_min_tokens} tokens computed (SWAP_MIN_TOKENS = "
          f"{SWAP_MIN_TOKENS})")  # fmt: skip
    print("| mode | pool blocks | preemptions | swapped | tokens computed | tier hit tokens "
          "| blocks swapped in | wall s | out tok/s | vs recompute |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    modes: dict[str, dict] = {}
    for name, min_tokens in (("recompute", 0), ("tier", None), ("swap", args.swap_min_tokens)):
        with tempfile.TemporaryDirectory() as d:
            r = modes[name] = run_preempt(args, d if name != "recompute" else None, min_tokens)
        base = modes["recompute"]["tok_s"]
        print(f"| {name} | {r['blocks']} | {r['preemptions']} | {r['swapped']} | {r['computed']} "
              f"| {r['hits']} | {r['swap_in']} | {r['wall']:.1f} | {r['tok_s']:.2f} "
              f"| x{r['tok_s'] / base:.2f} |", flush=True)  # fmt: skip
    same = [r["answers"] == modes["recompute"]["answers"] for r in modes.values()]
    print(f"answers equal to recompute's: {sum(same)}/{len(same)} modes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-ratio", type=float, default=4.0)
    p.add_argument("--tier-gib", type=float, default=2.0)
    p.add_argument("--workload", choices=("chat", "preempt", "swap-cost"), default="chat")
    p.add_argument("--swap-min-tokens", type=int, default=None,
                   help="preempt: the swap mode's threshold (default SWAP_MIN_TOKENS)")  # fmt: skip
    p.add_argument(
        "--backends",
        default="disk,cpu",
        help="chat: the tiers run against recompute, comma-separated --kv-offloading-backend "
        "values (disk: files; cpu: host memory)",
    )
    p.add_argument("--preempt-tokens", type=int, default=64, help="preempt: tokens per request")
    args = p.parse_args()
    if args.workload == "swap-cost":
        from kv_swap_cost import measure, report

        return report(measure(args.model, args.dtype))
    if args.workload == "preempt":
        if args.swap_min_tokens is None:
            from engine.core.kv_swap import SWAP_MIN_TOKENS

            args.swap_min_tokens = SWAP_MIN_TOKENS
        return main_preempt(args)
    recompute = run_mode(args, None)
    rows = [("recompute", recompute)]
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as d:
            rows.append((f"tier {backend}", run_mode(args, d, backend)))
    tier = rows[1][1]
    print(
        f"pool {tier['blocks']} blocks, prefix working set ~{tier['working_set_blocks']} blocks "
        f"({tier['working_set_blocks'] / tier['blocks']:.1f}x); {args.users} users x "
        f"{args.rounds} rounds; TTFT over rounds 2..{args.rounds}"
    )
    print("| mode | TTFT p50 s | TTFT p90 s | prompt tokens computed | tier hit tokens "
          "| MiB stored | MiB loaded | wall s | req/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['p50']:.3f} | {r['p90']:.3f} | {r['prefill']} | {r['hits']} "
            f"| {r['stored'] / 2**20:.1f} | {r['loaded'] / 2**20:.1f} | {r['wall']:.1f} "
            f"| {r['req_s']:.2f} |"
        )
    for name, tier in rows[1:]:
        print(
            f"{name}/recompute: TTFT p50 x{tier['p50'] / recompute['p50']:.2f}, "
            f"p90 x{tier['p90'] / recompute['p90']:.2f}, prompt tokens "
            f"x{tier['prefill'] / recompute['prefill']:.2f}, req/s "
            f"x{tier['req_s'] / recompute['req_s']:.2f}; answers equal "
            f"{sum(a == b for a, b in zip(tier['answers'], recompute['answers']))}"
            f"/{len(tier['answers'])}"
        )


if __name__ == "__main__":
    main()
