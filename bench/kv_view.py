"""What the playground's KV view costs the engine (engine/core/kv_view.py, server/kv_api.py).

1. Snapshot cost at 1k and 100k blocks, pool ~90% held by up to 256 running requests that
   share a prefix: `take_snapshot` (the part on the engine thread) the first time (every
   table copied) and in steady state (a decode step between captures: only new ids copied),
   against one pass over every block's ref_cnt (what it avoids), and the JSON / SSE encoding
   (event loop or a worker thread, never the engine thread).
2. Step time without a subscriber, with one (captures at the view's bound, 10 per second)
   and with a capture after every step (the worst case): schedule() + a null model runner +
   update_from_output() + KVView.on_step in decode steady state, the cheapest step there is,
   so the view's share is the largest it can be. Half the pool is held at the start and the
   run stops before it fills, so nothing is preempted.

With `--groups gemma3` the scheduler has Gemma 3's six KV cache groups (one full, five with a
512-token window), so each request has six tables and the sliding ones have entries that slid
out of the window to mark: the view's cost with groups.

Times are this thread's CPU time (time.thread_time), medians of repeats.
Usage: python bench/kv_view.py [--blocks 1000 100000] [--repeats 3] [--groups gemma3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.config import EngineConfig
from engine.core.kv_view import KVView, take_snapshot
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from server.kv_api import StreamEncoder, snapshot_payload

BLOCK_SIZE = 16
NUM_REQUESTS = 256
SHARED_PREFIX_BLOCKS = 4
GROUPS = {"llama": (0,), "gemma3": (0, 512, 512, 512, 512, 512)}


def blocks_per_request(num_table_blocks: int, windows: tuple[int, ...]) -> int:
    """Blocks one decoding request holds over its groups with num_table_blocks table entries."""
    return sum(
        min(num_table_blocks, -(-(w - 1) // BLOCK_SIZE) + 1) if w else num_table_blocks
        for w in windows
    )


def build(num_blocks: int, fill: float, windows: tuple[int, ...] = (0,)) -> Scheduler:
    """Up to 256 running requests holding `fill` of the pool, then a few steps of decode."""
    num_requests = min(NUM_REQUESTS, num_blocks // (32 * len(windows)))
    budget = max(int(num_blocks * fill) // num_requests, SHARED_PREFIX_BLOCKS + 1)
    per_request = SHARED_PREFIX_BLOCKS + 1  # table length whose blocks over all groups fit
    while blocks_per_request(per_request + 1, windows) <= budget:
        per_request += 1
    cfg = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=num_requests,
        max_num_batched_tokens=1 << 22,
        max_model_len=(per_request + 2 * num_blocks // num_requests) * BLOCK_SIZE,
    )
    sched = Scheduler(cfg, num_blocks, windows)
    prefix = list(range(SHARED_PREFIX_BLOCKS * BLOCK_SIZE))
    for i in range(num_requests):
        own = [1000 + (i * 7919 + j) % 30000 for j in range((per_request - 5) * BLOCK_SIZE)]
        prompt = prefix + own + [i]
        max_tokens = cfg.max_model_len - len(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params))
    # Sliding groups hold every prompt block until the step after the prefill: with groups not
    # all requests fit at once, so step until every one is decoding (a few steps).
    for _ in range(100):
        if not sched.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                     for r in sched.running):
            break
        step(sched)
    for _ in range(3):
        step(sched)
    return sched


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sampled = [
        7 if c + n == r.num_tokens else None
        for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
    ]
    sched.update_from_output(out, ModelRunnerOutput(sampled))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def snapshot_costs(num_blocks: int, windows: tuple[int, ...]) -> dict:
    sched = build(num_blocks, 0.9, windows)
    pool = sched.kv_cache_manager.block_pool
    snap = take_snapshot(sched)
    view = KVView(sched)
    steady = []
    for _ in range(20):
        view.capture_now()
        step(sched)
        t0 = time.thread_time()
        view.capture_now()
        steady.append(time.thread_time() - t0)
    encoder = StreamEncoder()
    later = take_snapshot(sched)
    return {
        "blocks": num_blocks,
        "running": len(sched.running),
        "held": pool.num_blocks - pool.get_num_free_blocks(),
        "first_us": 1e6 * timed(lambda: take_snapshot(sched), 20),
        "steady_us": 1e6 * statistics.median(steady),
        "ref_cnt_pass_us": 1e6 * timed(lambda: [b.ref_cnt for b in pool.blocks], 20),
        "snapshot_json_ms": 1e3 * timed(lambda: snapshot_payload(snap), 5),
        "sse_update_ms": 1e3 * timed(lambda: _encode_update(encoder, snap, later), 5),
    }


def _encode_update(encoder: StreamEncoder, prev, cur) -> None:
    encoder.prev = encoder.prev_codes = None
    encoder.encode(prev)
    t0 = time.thread_time()
    encoder.encode(cur)
    return time.thread_time() - t0


def step_times(num_blocks: int, repeats: int, windows: tuple[int, ...]) -> dict:
    result = {"blocks": num_blocks}
    modes = {"without": None, "with": 10.0, "every_step": float("inf")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    snapshots = dict.fromkeys(modes, 0)
    for _ in range(repeats):  # modes interleaved, so a noisy neighbour hits them alike
        for mode, rate in modes.items():
            sched = build(num_blocks, 0.5, windows)
            view = KVView(sched, max_updates_per_s=rate or 10.0)
            captured = []
            if rate is not None:
                view.subscribe(captured.append)
            num_steps = int(0.4 * num_blocks * BLOCK_SIZE / len(sched.running))
            pool = sched.kv_cache_manager.block_pool
            reserve = num_blocks // 10 + len(sched.running) * len(windows)
            for _ in range(min(num_steps, 2000)):
                if pool.get_num_free_blocks() < reserve:  # stop before anything is preempted
                    break
                t0 = time.thread_time()
                step(sched)
                view.on_step(0, 0)
                times[mode].append(time.thread_time() - t0)
            assert sched.num_preemptions_total == 0
            snapshots[mode] += len(captured)
    for mode in modes:
        result[f"step_us_{mode}"] = 1e6 * statistics.mean(times[mode])
        result[f"steps_{mode}"] = len(times[mode])
        result[f"snapshots_{mode}"] = snapshots[mode]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1000, 100_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", choices=sorted(GROUPS), default="llama")
    args = ap.parse_args()
    windows = GROUPS[args.groups]
    print(f"KV cache groups (window per group): {windows}")
    for n in args.blocks:
        c = snapshot_costs(n, windows)
        print(
            f"{n:>7} blocks, {c['running']} running, {c['held']} held: take_snapshot (engine "
            f"thread) {c['first_us']:.0f} us first, {c['steady_us']:.0f} us steady; one pass "
            f"over all blocks' ref_cnt {c['ref_cnt_pass_us']:.0f} us · elsewhere: snapshot "
            f"JSON {c['snapshot_json_ms']:.1f} ms, SSE update {c['sse_update_ms']:.1f} ms"
        )
    for n in args.blocks:
        s = step_times(n, args.repeats, windows)
        base = s["step_us_without"]
        print(
            f"{n:>7} blocks, null-runner decode step: {base:.1f} us without a subscriber; "
            f"{s['step_us_with']:.1f} us (x{s['step_us_with'] / base:.3f}) with one "
            f"({s['snapshots_with']} captures in {s['steps_with']} steps); "
            f"{s['step_us_every_step']:.1f} us (x{s['step_us_every_step'] / base:.3f}) "
            "capturing after every step"
        )


if __name__ == "__main__":
    main()
