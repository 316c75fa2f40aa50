"""What a swap costs against a recompute on this machine: the measurement behind the swap rule
(engine/core/kv_swap.py, SWAP_MIN_TOKENS). Run through `python bench/kv_tier.py --workload
swap-cost` (or this file).

- recompute: the time to prefill T tokens of a request (one request, a cold pool), at several T;
  the slope is the cost per token a recompute preemption pays again.
- swap: per block, the snapshot on the loop (the runner hook), the copy thread's file write and
  read (on a 2-core host it competes with the loop for a core, so it is counted), and the copy
  back into the KV cache on the loop.
- the swap's fixed cost: the resumed request waits one step more (its loads land a step after
  they are asked for); counted as one decode step of a 4-request batch.

The crossover T* solves slope * T = per_block * ceil(T / block_size) + step: below it recompute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from engine.config import EngineConfig
from engine.core.kv_swap import SWAP_MIN_TOKENS, SWAP_PREFIX
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _prefill_s(engine, tokens: list[int], rid: str) -> float:
    engine.add_request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def _decode_step_s(engine, vocab: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rng = random.Random(2)
    for i in range(4):
        engine.add_request(f"d{i}", [rng.randrange(100, vocab) for _ in range(32)], params)
    times = []
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        if stats.num_prompt_tokens == 0 and stats.num_generation_tokens == 4:
            times.append(stats.step_time)
    return statistics.median(times)


def _swap_block_s(engine, num_blocks: int) -> dict:
    off = engine.kv_offload
    hook, store = off.hook, off.store
    keys = [(i + 1, SWAP_PREFIX + i.to_bytes(32, "little")) for i in range(num_blocks)]
    t0 = time.perf_counter()
    hook.store_blocks(keys)  # snapshot (loop) and queue the writes
    t1 = time.perf_counter()
    while store._swap_pending:  # the copy thread writes
        time.sleep(0.0005)
    t2 = time.perf_counter()
    for block_id, key in keys:
        store.submit_load(block_id, key)
    results: list = []
    while len(results) < num_blocks:  # the copy thread reads and verifies
        store.wait_for_load(0.01)
        results += store.poll_loads()
    t3 = time.perf_counter()
    for block_id, payload in results:
        hook._write_block(block_id, payload)  # back into the KV cache (loop)
    t4 = time.perf_counter()
    n = num_blocks
    return dict(snapshot=(t1 - t0) / n, write=(t2 - t1) / n, read=(t3 - t2) / n,
                apply=(t4 - t3) / n, block_kib=hook.block_bytes / 1024)  # fmt: skip


def measure(model: str | None, dtype: str, lengths=(16, 64, 256)) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cfg = EngineConfig(model=model, dtype=dtype, kv_offloading_size=1.0, kv_offloading_dir=d,
                           enable_prefix_caching=False)  # fmt: skip
        engine = LLMEngine(cfg)
        bs, vocab = engine.config.block_size, min(engine.vocab_size, 30000)
        rng = random.Random(1)
        _prefill_s(engine, [rng.randrange(100, vocab) for _ in range(16)], "warm")
        prefill = {}
        for n in lengths:
            runs = [_prefill_s(engine, [rng.randrange(100, vocab) for _ in range(n)], f"p{n}-{k}")
                    for k in range(3)]  # fmt: skip
            prefill[n] = statistics.median(runs)
        step = _decode_step_s(engine, vocab)
        swap = _swap_block_s(engine, 16)
        engine.shutdown()
    lo, hi = lengths[0], lengths[-1]
    slope = (prefill[hi] - prefill[lo]) / (hi - lo)
    per_block = swap["snapshot"] + swap["write"] + swap["read"] + swap["apply"]
    crossover = next(
        (t for t in range(1, 4097) if slope * t > per_block * -(-t // bs) + step), None
    )
    return dict(bs=bs, prefill=prefill, slope=slope, step=step, swap=swap, per_block=per_block,
                crossover=crossover)  # fmt: skip


def report(m: dict) -> None:
    bs, sw = m["bs"], m["swap"]
    print("| context T | prefill s |")
    print("|---|---|")
    for n, s in m["prefill"].items():
        print(f"| {n} | {s:.4f} |")
    print(f"recompute: {m['slope'] * 1e3:.3f} ms per token (slope); "
          f"decode step (4 requests): {m['step'] * 1e3:.1f} ms")  # fmt: skip
    print(f"swap per {bs}-token block ({sw['block_kib']:.0f} KiB): snapshot "
          f"{sw['snapshot'] * 1e3:.3f} ms + write {sw['write'] * 1e3:.3f} + read "
          f"{sw['read'] * 1e3:.3f} + apply {sw['apply'] * 1e3:.3f} = "
          f"{m['per_block'] * 1e3:.3f} ms "
          f"({m['per_block'] / bs * 1e3:.4f} ms per token)")  # fmt: skip
    ratio = m["slope"] * bs / m["per_block"] if m["per_block"] else float("inf")
    print(f"per token, recompute / swap = x{ratio:.1f}; crossover (swap wins from) "
          f"T* = {m['crossover']} tokens; SWAP_MIN_TOKENS = {SWAP_MIN_TOKENS}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    report(measure(args.model, args.dtype))


if __name__ == "__main__":
    main()
