"""The second KV tier under tensor parallelism (engine/kv_offload/tp_worker.py, tp_index.py):
each rank stores and loads its own shard in its own folder; the engine counts a block stored or
loaded only once every rank has it. Greedy float32 at two ranks, with a pool too small for the
working set, equals transformers and one rank; a restart at TP=2 serves a repeated prompt from
the tier, one at TP=1 never reuses TP=2's files. Also: a request preempted whose evicted prefix
then comes back from the tier (one rank, stepped so the disk is never late)."""

from __future__ import annotations

import logging
import time

import pytest
from conftest import build_tiny_model_dir, count_prefill_tokens, hf_greedy, make_prompts
from test_kv_offload import BS, MAX_NEW, PARAMS, _assert_all_free, _check_metrics, _one_by_one

from engine import LLM, SamplingParams
from engine.kv_offload.tp_index import RankedTierIndex

NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # vocab 260: the byte tokenizer's 259 ids padded so the vocabulary splits over two ranks
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-tp"), seed=4, vocab_size=260)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(4, min_len=40, max_len=44, seed=3)


def _llm(model_dir, tier_dir, tp: int, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32,
        block_size=BS, kv_offloading_size=0.01,
        kv_offloading_dir=str(tier_dir), tensor_parallel_size=tp, **kw,
    )  # fmt: skip


def _rank_files(tier_dir, rank: int) -> set[str]:
    return {p.name for p in tier_dir.glob(f"tp2-rank{rank}/*/*.kv")}


def test_index_counts_a_block_only_when_every_rank_has_it():
    index = RankedTierIndex(2, None)
    a, b = b"a" * 32, b"b" * 32

    def report(rank, changes=(), applied=()):
        return dict(rank=rank, changes=list(changes), applied=list(applied), stored=10 * rank,
                    loaded=0, usage=5, capacity=50, corrupt=rank)  # fmt: skip

    first = report(0, [(a, True), (b, True)], [(7, True), (8, True)])
    index.absorb([first, report(1, [(a, True)])])
    assert index.contains(a) and not index.contains(b) and len(index) == 1
    assert index.applied == []  # rank 1 has not copied its shard of block 7 or 8 yet
    index.absorb([report(0, [(a, False)]), report(1, [(b, True)], [(7, True), (8, False)])])
    assert not index.contains(a) and index.contains(b) and len(index) == 1
    assert index.applied == [(7, True), (8, False)]  # 8: one rank's read failed, so no hit
    assert (index.usage_bytes, index.capacity_bytes, index.bytes_stored_total) == (10, 100, 10)
    assert index.num_corrupt_total == 1


def test_two_ranks_with_a_tier_equal_transformers_and_one_rank(model_dir, tmp_path, prompts):
    turns = [p + [5, 6, 7, 8, 9] for p in prompts]
    ref, ref_turns = hf_greedy(model_dir, prompts, MAX_NEW), hf_greedy(model_dir, turns, MAX_NEW)
    one = _llm(model_dir, tmp_path / "one", 1)
    assert _one_by_one(one, prompts) == ref and _one_by_one(one, turns) == ref_turns
    one_hits = one.engine.kv_offload.tier.hit_tokens_total
    one.engine.shutdown()
    two = _llm(model_dir, tmp_path / "two", 2)
    try:
        assert two.engine.config.distributed_executor_backend == "mp"
        off = two.engine.kv_offload
        assert _one_by_one(two, prompts) == ref  # fills the pool; earlier prefixes go to disk
        counted = count_prefill_tokens(two)
        assert _one_by_one(two, turns) == ref_turns
        assert off.tier.hit_tokens_total >= 3 * 40 and one_hits >= 3 * 40
        assert off.store.bytes_loaded_total > 0 and counted[0] < sum(map(len, turns)) / 2
        hits = off.tier.hit_tokens_total
        outs = two.generate(prompts, PARAMS, use_tqdm=False)  # all at once
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert off.tier.hit_tokens_total > hits
        _assert_all_free(two)
        _check_metrics(two)
        assert off.tier.num_failed_loads_total == 0
    finally:
        two.engine.shutdown()
    # Each rank wrote its own shard of the same blocks: same names, half the bytes each.
    tier = tmp_path / "two"
    names = _rank_files(tier, 0)
    assert len(names) >= 20 and names == _rank_files(tier, 1)
    size = {r: next(tier.glob(f"tp2-rank{r}/*/*.kv")).stat().st_size for r in (0, 1)}
    one_size = next((tmp_path / "one").glob("*/*.kv")).stat().st_size
    assert size[0] == size[1] < one_size


def test_restart_at_two_ranks_hits_the_tier_and_one_rank_does_not_reuse(
    model_dir, tmp_path, prompts, caplog
):
    long_prompt = prompts[0] + prompts[1]  # 80+ tokens
    ref = hf_greedy(model_dir, [long_prompt], MAX_NEW)
    first = _llm(model_dir, tmp_path, 2)
    try:
        assert _one_by_one(first, [long_prompt]) == ref
    finally:
        first.engine.shutdown()  # flushes the pool's cached blocks on every rank
    assert len(_rank_files(tmp_path, 0)) >= len(long_prompt) // BS
    second = _llm(model_dir, tmp_path, 2)
    try:
        warm = count_prefill_tokens(second)
        assert len(second.engine.kv_offload.store) >= len(long_prompt) // BS  # found at start
        assert _one_by_one(second, [long_prompt]) == ref
        assert second.engine.kv_offload.tier.hit_tokens_total >= len(long_prompt) - BS - 1
        assert warm[0] <= BS  # only the last partial block (and the token for logits) computed
        _assert_all_free(second)
    finally:
        second.engine.shutdown()
    one = _llm(model_dir, tmp_path, 1)
    store = one.engine.kv_offload.store
    assert len(store) == 0 and store.directory.parent == tmp_path  # no tp2-rank folder
    # TP=2's rank-0 files copied into TP=1's folder: their header's fingerprint tells them apart.
    for path in tmp_path.glob("tp2-rank0/*/*.kv"):
        (store.directory / path.name).write_bytes(path.read_bytes())
    one.engine.shutdown()
    one = _llm(model_dir, tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="engine.kv_offload.disk_store"):
        assert _one_by_one(one, [long_prompt]) == ref
    assert any("another model" in r.getMessage() for r in caplog.records)
    assert one.engine.kv_offload.tier.hit_tokens_total == 0
    _assert_all_free(one)
    one.engine.shutdown()


def _drain(store, max_s: float = 30.0) -> None:
    """Waits until every queued write is on disk (a fast disk: keeps the test deterministic)."""
    deadline = time.monotonic() + max_s
    while store._pending and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not store._pending


def test_a_preempted_request_gets_its_evicted_prefix_back_from_the_tier(model_dir, tmp_path):
    long_prompt, short = make_prompts(2, min_len=32, max_len=32, seed=11)
    short = short[:8]
    params = {"long": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              "short": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)}  # fmt: skip
    llm = _llm(model_dir, tmp_path, 1, num_gpu_blocks_override=16)
    engine, off = llm.engine, llm.engine.kv_offload
    sched = engine.scheduler
    sched.kv_swap.min_tokens = None  # a recompute preemption (tests/test_kv_swap.py: swap)
    # 16 blocks of 4 cannot hold both (13 + 12 blocks at the end). "short" came first: as they
    # grow, "long" (the later arrival) is preempted, and "short" evicts its freed blocks; they
    # go to the tier and "long" loads them back on resume.
    engine.add_request("short", short, params["short"])
    engine.add_request("long", long_prompt, params["long"])
    done: dict[str, list[int]] = {}
    preempted_at = None
    for _ in range(500):
        if len(done.get("finished", ())) == 2:
            break
        outputs, _ = engine.step()
        _drain(off.store)
        sched.kv_cache_manager.check_integrity()
        if preempted_at is None and sched.num_preemptions_total:
            preempted_at = off.tier.hit_tokens_total
        for o in outputs:
            done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            done.setdefault("finished", []).extend([o.request_id] if o.finished else [])
    assert preempted_at == 0 and sched.num_preemptions_total >= 1
    assert off.tier.hit_tokens_total >= 4 * BS  # "long"'s evicted prefix came back
    assert done["long"] == hf_greedy(model_dir, [long_prompt], 20)[0]
    assert done["short"] == hf_greedy(model_dir, [short], 40)[0]
    _assert_all_free(llm)
    engine.shutdown()


def test_the_fingerprint_names_the_tp_size_and_rank(model_dir):
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.distributed import ParallelState
    from engine.kv_offload.setup import runner_fingerprint

    cfg = EngineConfig(block_size=BS)

    def fp(rank: int, world: int) -> bytes:  # the same heads per rank: only the TP state differs
        runner = SimpleNamespace(
            kv_cache_spec=SimpleNamespace(windows=(0,), layer_groups=((0, 1),)),
            tp=ParallelState(rank, world), num_kv_heads=1, head_dim=16, dtype="torch.float32",
        )  # fmt: skip
        return runner_fingerprint(cfg, model_dir, runner)

    prints = {fp(0, 1), fp(0, 2), fp(1, 2), fp(0, 4)}
    assert len(prints) == 4 and fp(1, 2) == fp(1, 2)
