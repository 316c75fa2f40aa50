"""Microseconds per KV cache bookkeeping operation (pure Python, no model, no torch).

    python bench/micro/block_pool_ops.py [--block-size 16] [--repeat 5]

Each row is the best of --repeat timeit runs (the least disturbed by other processes). The
last row times one iteration of an empty Python for loop on the same machine, so numbers from a
loaded or slow machine can be scaled (about 10 ns on an idle modern core).
"""

from __future__ import annotations

import argparse

from harness import measure, reps_for

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

NUM_BLOCKS = 4096


def make_request(request_id: str, num_tokens: int, start: int = 0) -> Request:
    tokens = [start + i for i in range(num_tokens)]
    return Request(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=1))


def bench_pool_alloc_free(num_blocks: int):
    pool = BlockPool(NUM_BLOCKS)

    def op() -> None:
        pool.free_blocks(reversed(pool.get_new_blocks(num_blocks)))

    return op


def bench_manager_alloc_free(num_blocks: int, block_size: int, caching: bool):
    """allocate_slots for a whole prompt then free, as a request's life brackets it."""
    kv = KVCacheManager(NUM_BLOCKS, block_size, enable_caching=caching)
    req = make_request("r", num_blocks * block_size)
    req.status = RequestStatus.FINISHED_STOPPED  # free() drops everything, hashes included

    def op() -> None:
        kv.allocate_slots(req, req.num_tokens)
        kv.free(req)

    return op


def _cached_manager(num_blocks: int, block_size: int) -> KVCacheManager:
    kv = KVCacheManager(NUM_BLOCKS, block_size)
    seed = make_request("seed", (num_blocks + 1) * block_size)
    kv.allocate_slots(seed, seed.num_tokens)
    seed.status = RequestStatus.FINISHED_STOPPED
    kv.free(seed)  # num_blocks + 1 cached free blocks
    return kv


def bench_lookup(num_blocks: int, block_size: int, fresh: bool):
    """get_computed_blocks hitting num_blocks blocks; fresh: a new request, so hashing counts."""
    kv = _cached_manager(num_blocks, block_size)
    num_tokens = (num_blocks + 1) * block_size
    req = make_request("q", num_tokens)

    def op() -> None:
        if fresh:
            kv.req_to_block_hashes.pop("q", None)
        hits, num_hit = kv.get_computed_blocks(req)
        assert num_hit == num_blocks * block_size

    return op


def bench_hit_admit_free(num_blocks: int, block_size: int):
    """A new request's whole life in the manager: lookup, allocate with the hit, free."""
    kv = _cached_manager(num_blocks, block_size)
    req = make_request("q", (num_blocks + 1) * block_size)
    req.status = RequestStatus.FINISHED_STOPPED

    def op() -> None:
        hits, num_hit = kv.get_computed_blocks(req)
        kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
        kv.free(req)

    return op


def time_op(op, repeat: int) -> float:
    """Best-of-repeat microseconds per call, each run about 0.2 s of calls."""
    return 1e6 * measure(op, repeat, stat=min, reps=reps_for(op, 0.2), warmup=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    bs = args.block_size
    rows = [
        ("BlockPool get_new_blocks+free_blocks", 128, bench_pool_alloc_free(128)),
        ("allocate_slots+free, caching off", 128, bench_manager_alloc_free(128, bs, False)),
        ("allocate_slots+free, caching on (hashes)", 128, bench_manager_alloc_free(128, bs, True)),
        ("get_computed_blocks hit, hashes memoized", 32, bench_lookup(32, bs, fresh=False)),
        ("get_computed_blocks hit, new request", 32, bench_lookup(32, bs, fresh=True)),
        ("lookup+allocate_slots+free with the hit", 32, bench_hit_admit_free(32, bs)),
    ]
    print(f"pool of {NUM_BLOCKS} blocks, block_size {bs}, best of {args.repeat}")
    print(f"{'operation':44} {'blocks':>6} {'us/op':>9} {'ns/block':>9}")
    for name, num_blocks, op in rows:
        us = time_op(op, args.repeat)
        print(f"{name:44} {num_blocks:6d} {us:9.1f} {us * 1000 / num_blocks:9.0f}")
    loop_us = time_op(lambda: [None for _ in range(1000)], args.repeat)
    print(
        f"{'(calibration: empty loop, 1000 iterations)':44} {1000:6d} {loop_us:9.1f} {loop_us:9.1f}"
    )


if __name__ == "__main__":
    main()
