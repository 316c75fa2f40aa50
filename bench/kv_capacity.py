"""How many requests fit in one fixed KV budget: paged blocks versus reserve-the-maximum.

Workload: requests that may run to max_model_len (4096) but stop at about 1500 tokens
(prompt 300-700, EOS at 1400-1600 in total). Both allocators get the same token budget and
the same step model (token budget per step, FCFS admission, one token per decode):

  paged       pagedserve's real Scheduler + KVCacheManager with a null model runner that
              samples EOS when a request reaches its stop length (blocks on demand)
  contiguous  a slab of max_model_len slots reserved per request on admission, as a server
              without paging must (it cannot know where a request stops)

Reports, averaged over the steps where the workload was still arriving (steady state):
running requests, the share of the KV memory holding real tokens, and the internal waste per
request (allocated slots - tokens) in blocks. No torch, no model: pure bookkeeping.

--sliding: the sliding-window case. A Gemma-3-like stack (18 layers, 5 local : 1 global, local
window 512 or 1024) with the same KV memory laid out two ways, through the real Scheduler:

  hybrid      KV cache groups (engine/core/kv_cache_groups.py): 6 groups of 3 layers over one pool,
              the local groups returning blocks that slid out of the window
  keep-all    one group of all 18 layers: every layer keeps every block

Requests of 4k and 8k tokens (the prompt, then 128 decoded tokens). Reports per request the KV
held at its longest, in layer-blocks (one layer's K and V of one block: the unit of memory), and
how many decoding requests fit in the budget (fit = budget // KV per request) and how many
run at once while others wait (prefill chunks hold more, so fewer than fit).

  python bench/kv_capacity.py
  python bench/kv_capacity.py --sliding
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.core.kv_cache_groups import plan_kv_groups
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams

_EOS = 2
_OTHER = 7


@dataclass
class Spec:
    prompt_len: int
    stop_len: int  # total tokens (prompt + output) at which it samples EOS


@dataclass
class CapacityStats:
    allocator: str
    num_steps: int
    max_running: int
    mean_running: float
    mean_kv_held_frac: float  # slots allocated or reserved / budget
    mean_real_token_frac: float  # tokens in KV / slots allocated or reserved
    mean_waste_blocks_per_req: float
    max_waste_blocks_per_req: float
    num_preemptions: int


def make_specs(n: int, seed: int) -> list[Spec]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(300, 701, n)
    stops = rng.integers(1400, 1601, n)
    return [Spec(int(p), int(s)) for p, s in zip(prompts, stops)]


class _Tracker:
    """Per-step samples while the waiting queue is non-empty (steady state under pressure)."""

    def __init__(self) -> None:
        self.running: list[int] = []
        self.held: list[float] = []
        self.real: list[float] = []
        self.waste: list[float] = []

    def sample(self, held: list[int], tokens: list[int], budget: int, block_size: int) -> None:
        """held[i] slots allocated (or reserved) for a request holding tokens[i] tokens."""
        self.running.append(len(held))
        self.held.append(sum(held) / budget)
        self.real.append(sum(tokens) / max(sum(held), 1))
        self.waste.extend((h - t) / block_size for h, t in zip(held, tokens))

    def stats(self, name: str, num_steps: int, max_running: int, preemptions: int):
        return CapacityStats(
            name,
            num_steps,
            max_running,
            float(np.mean(self.running)),
            float(np.mean(self.held)),
            float(np.mean(self.real)),
            float(np.mean(self.waste)),
            float(np.max(self.waste)),
            preemptions,
        )


def run_paged(specs, num_blocks, block_size, max_model_len, max_batched) -> CapacityStats:
    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=1024,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=False,
    )
    sched = Scheduler(cfg, num_blocks)
    kv = sched.kv_cache_manager
    stop_at = {}
    for i, s in enumerate(specs):
        params = SamplingParams(temperature=0.0, max_tokens=max_model_len - s.prompt_len)
        req = Request(str(i), list(range(1000, 1000 + s.prompt_len)), params, eos_token_id=_EOS)
        stop_at[req.request_id] = s.stop_len
        sched.add_request(req)
    tracker, steps, max_running = _Tracker(), 0, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        max_running = max(max_running, len(sched.running))
        if sched.waiting:
            held = [len(kv.get_block_ids(r.request_id)) * block_size for r in sched.running]
            tokens = [r.num_computed_tokens for r in sched.running]
            tracker.sample(held, tokens, num_blocks * block_size, block_size)
        sampled = [
            _null_sample(r, n, c, stop_at)
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ]
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    assert kv.block_pool.get_num_free_blocks() == num_blocks, "blocks leaked"
    return tracker.stats("paged", steps, max_running, sched.num_preemptions_total)


def _null_sample(req, num_new, num_computed, stop_at):
    if num_computed + num_new != req.num_tokens:
        return None  # partial prefill chunk
    return _EOS if req.num_tokens + 1 >= stop_at[req.request_id] else _OTHER


def run_contiguous(specs, num_blocks, block_size, max_model_len, max_batched) -> CapacityStats:
    budget = num_blocks * block_size
    waiting = list(range(len(specs)))
    running: dict[int, int] = {}  # spec index -> tokens with KV
    tracker, steps, max_running = _Tracker(), 0, 0
    while waiting or running:
        steps += 1
        tokens_left = max_batched
        for i in list(running):  # running first: prefill chunks or one decode token
            todo = specs[i].prompt_len - running[i] if running[i] < specs[i].prompt_len else 1
            take = min(todo, tokens_left)
            running[i] += take
            tokens_left -= take
        while waiting and (len(running) + 1) * max_model_len <= budget and tokens_left > 0:
            i = waiting.pop(0)
            running[i] = min(specs[i].prompt_len, tokens_left)
            tokens_left -= running[i]
        max_running = max(max_running, len(running))
        if waiting:
            tokens = list(running.values())
            tracker.sample([max_model_len] * len(tokens), tokens, budget, block_size)
        for i in [i for i, t in running.items() if t >= specs[i].stop_len]:
            del running[i]
    return tracker.stats("contiguous", steps, max_running, 0)


def print_table(rows: list[CapacityStats], budget_tokens: int, block_size: int) -> None:
    print(
        f"KV budget {budget_tokens} tokens ({budget_tokens // block_size} blocks of "
        f"{block_size}); requests reserve up to 4096 tokens, stop at ~1500"
    )
    head = (
        f"{'allocator':<11} {'max run':>7} {'mean run':>8} {'KV held':>8} "
        f"{'real tok':>8} {'waste/req (blocks)':>19} {'steps':>6} {'preempt':>7}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.allocator:<11} {r.max_running:>7} {r.mean_running:>8.1f} "
            f"{r.mean_kv_held_frac:>8.1%} {r.mean_real_token_frac:>8.1%} "
            f"{r.mean_waste_blocks_per_req:>9.2f} (max {r.max_waste_blocks_per_req:>5.1f}) "
            f"{r.num_steps:>6} {r.num_preemptions:>7}"
        )
    paged, contig = rows
    print(
        f"paged runs {paged.mean_running / contig.mean_running:.1f}x as many requests at once; "
        f"contiguous wastes {1 - contig.mean_real_token_frac:.0%} of what it reserves, paged "
        f"{1 - paged.mean_real_token_frac:.1%}"
    )


@dataclass
class SlidingStats:
    layout: str
    window: int
    num_tokens: int
    layer_blocks_per_req: int  # most KV one decoding request held, in layer-blocks
    prefill_peak_layer_blocks: int  # most it held at once, prefill chunks included
    mean_running: float
    max_running: int
    num_preemptions: int


GEMMA3_LAYERS = 18
GEMMA3_PATTERN = 6  # every 6th layer global
SLIDING_DECODE = 128


def run_sliding(
    layout: str, window: int, num_tokens: int, num_requests: int, budget_layer_blocks: int,
    block_size: int, max_batched: int,
) -> SlidingStats:
    windows = [window if (i + 1) % GEMMA3_PATTERN else 0 for i in range(GEMMA3_LAYERS)]
    spec = plan_kv_groups(windows if layout == "hybrid" else [0] * GEMMA3_LAYERS)
    num_blocks = budget_layer_blocks // spec.num_slots
    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=1024,
        max_model_len=num_tokens + 1,
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=False,
    )
    sched = Scheduler(cfg, num_blocks, spec.windows)
    kv = sched.kv_cache_manager
    prompt_len = num_tokens - SLIDING_DECODE
    for i in range(num_requests):
        params = SamplingParams(temperature=0.0, max_tokens=SLIDING_DECODE, ignore_eos=True)
        prompt = list(range(10_000 * i, 10_000 * i + prompt_len))  # distinct: no prefix hits
        sched.add_request(Request(str(i), prompt, params))
    running_samples: list[int] = []
    decode_peak = prefill_peak = max_running = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        max_running = max(max_running, len(sched.running))
        if sched.waiting:
            running_samples.append(len(sched.running))
        for req in sched.running:
            held = kv.get_num_held_blocks(req.request_id) * spec.num_slots
            prefill_peak = max(prefill_peak, held)
            if req.num_computed_tokens > prompt_len:
                decode_peak = max(decode_peak, held)
        sampled = [
            _OTHER if c + n == r.num_tokens else None
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ]
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    assert kv.block_pool.get_num_free_blocks() == num_blocks, "blocks leaked"
    kv.check_integrity()
    return SlidingStats(
        layout, window, num_tokens, decode_peak, prefill_peak,
        float(np.mean(running_samples)) if running_samples else float(max_running),
        max_running, sched.num_preemptions_total,
    )


def sliding_main(args) -> list[SlidingStats]:
    budget = cdiv(args.kv_tokens, args.block_size) * GEMMA3_LAYERS  # layer-blocks
    print(
        f"Gemma-3-like stack: {GEMMA3_LAYERS} layers, 5 local : 1 global; KV budget "
        f"{args.kv_tokens} tokens of all layers ({budget} layer-blocks of {args.block_size}); "
        f"chunk {args.max_num_batched_tokens}; {args.num_requests} requests each"
    )
    print(
        f"{'window':>6} {'tokens':>6} {'layout':<9} {'KV/req (layer-blocks)':>21} "
        f"{'prefill peak':>12} {'fit':>4} {'mean run':>8} {'max run':>7} {'preempt':>7}"
    )
    rows = []
    for window in (512, 1024):
        for num_tokens in (4096, 8192):
            pair = [
                run_sliding(
                    layout, window, num_tokens, args.num_requests, budget, args.block_size,
                    args.max_num_batched_tokens,
                )
                for layout in ("hybrid", "keep-all")
            ]
            for r in pair:
                print(
                    f"{r.window:>6} {r.num_tokens:>6} {r.layout:<9} "
                    f"{r.layer_blocks_per_req:>21} {r.prefill_peak_layer_blocks:>12} "
                    f"{budget // r.layer_blocks_per_req:>4} {r.mean_running:>8.1f} "
                    f"{r.max_running:>7} {r.num_preemptions:>7}"
                )
            hybrid, full = pair
            less = full.layer_blocks_per_req / hybrid.layer_blocks_per_req
            more = hybrid.mean_running / full.mean_running
            print(f"{'':>14} hybrid: {less:.2f}x less KV per request, {more:.2f}x as many run")
            rows += pair
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--kv-tokens", type=int, default=65536, help="KV budget in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--sliding", action="store_true", help="the sliding-window case instead")
    args = p.parse_args()
    if args.sliding:
        rows = sliding_main(args)
        if args.out:
            Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2))
        return
    specs = make_specs(args.num_requests, args.seed)
    num_blocks = cdiv(args.kv_tokens, args.block_size)
    shape = (specs, num_blocks, args.block_size, args.max_model_len, args.max_num_batched_tokens)
    rows = [run_paged(*shape), run_contiguous(*shape)]
    print_table(rows, num_blocks * args.block_size, args.block_size)
    final = np.mean([s.stop_len for s in specs]) / args.max_model_len
    print(
        f"at its stop a request fills {final:.0%} of a {args.max_model_len}-token reservation "
        f"({1 - final:.0%} waste even at the end of its life)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
