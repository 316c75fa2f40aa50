"""Copy-on-write forks in the KV cache manager: unit cases, and the scheduler-like property
driver (tests/kv_driver.py) with forks for one full-attention group, a full and a sliding group,
and a sliding group alone: no leak, no block freed while readable, no write into a shared block,
every readable position holds its own prefix's KV, check_integrity after every operation, with
prefix hits, preemption of one request and of all."""

from __future__ import annotations

from dataclasses import replace

from conftest import (
    assert_scheduler_drained,
    make_request,
    make_scheduler,
    run_fake_step,
    run_until_done,
)
from hypothesis import settings
from kv_driver import KVCacheDriver

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus

BS = 4


def _fork(kv: KVCacheManager, parent, rid: str, num_tokens: int):
    child = Request(rid, parent.all_token_ids[:num_tokens], parent.sampling_params)
    kv.fork(parent, child, num_tokens)
    return child


def test_fork_shares_a_partial_last_block_and_copies_on_first_write():
    kv = KVCacheManager(16, BS)
    parent = make_request("p", 10)
    assert kv.allocate_slots(parent, 10) is not None
    parent.num_computed_tokens = 10
    child = _fork(kv, parent, "c", 10)
    shared = kv.req_to_blocks["p"]
    assert kv.req_to_blocks["c"] == shared and [b.ref_cnt for b in shared] == [2, 2, 2]
    assert shared[2].block_hash is None  # the partial block: shared, not cached
    kv.check_integrity()
    # the child recomputes token 9: a write into the shared partial block copies it first
    child.num_computed_tokens = 9
    assert kv.allocate_slots(child, 1) == []
    (copy,) = kv.take_block_copies()
    new = kv.req_to_blocks["c"][2]
    assert copy == (shared[2].block_id, new.block_id) and new.ref_cnt == 1
    assert shared[2].ref_cnt == 1 and kv.take_replaced_table("c")
    # the parent is now the only holder of its last block: it writes in place
    parent.all_token_ids.append(5)
    assert kv.allocate_slots(parent, 1) == [] and kv.take_block_copies() == []
    kv.check_integrity()
    for req in (parent, child):
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == 16


def test_a_copy_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(3, BS)
    parent = make_request("p", 10)
    assert kv.allocate_slots(parent, 10) is not None
    parent.num_computed_tokens = 10
    child = _fork(kv, parent, "c", 10)
    child.num_computed_tokens = 9
    assert kv.block_pool.get_num_free_blocks() == 0
    assert kv.allocate_slots(child, 1) is None  # the copy needs a block the pool lacks
    assert kv.req_to_blocks["c"] == kv.req_to_blocks["p"] and not kv.pending_copies
    kv.check_integrity()


class ForkMachine(KVCacheDriver):
    WINDOWS = (0,)
    NUM_BLOCKS = 8
    FORKS = True


class HybridForkMachine(KVCacheDriver):
    WINDOWS = (0, 6)
    NUM_BLOCKS = 14
    FORKS = True


class SlidingForkMachine(KVCacheDriver):
    WINDOWS = (5,)
    NUM_BLOCKS = 8
    FORKS = True


_SETTINGS = settings(max_examples=120, stateful_step_count=50, deadline=None)
for _machine in (ForkMachine, HybridForkMachine, SlidingForkMachine):
    _machine.TestCase.settings = _SETTINGS
test_forks_full_attention = ForkMachine.TestCase
test_forks_full_and_sliding_groups = HybridForkMachine.TestCase
test_forks_sliding_group_alone = SlidingForkMachine.TestCase


# ---- the scheduler's forks (engine/core/forks.py), with a null model runner -----------------
def _family(sched, n: int, num_tokens: int = 10, max_tokens: int = 4):
    reqs = [make_request(f"s{i}", num_tokens, max_tokens=max_tokens) for i in range(n)]
    for req in reqs[1:]:
        req.fork_parent_id = reqs[0].request_id
    for req in reqs:
        sched.add_request(req)
    return reqs


def test_scheduler_forks_after_the_prompt_and_sends_whole_tables_and_copies():
    sched = make_scheduler(block_size=BS)
    parent, a, b = _family(sched, 3)
    out, _ = run_fake_step(sched)
    assert out.requests == [parent] and len(sched.fork_waiting["s0"]) == 2
    out, _ = run_fake_step(sched)  # the fork: children recompute token 9 only
    assert out.requests == [parent, a, b]
    assert out.num_computed_tokens == [10, 9, 9] and out.num_scheduled_tokens == [1, 1, 1]
    assert out.block_table_reset == [True, True, True]  # copies replaced entries / new tables
    kv = sched.kv_cache_manager
    tables = [tuple(kv.get_block_ids(r.request_id)) for r in (parent, a, b)]
    assert [tuple(ids) for ids in out.new_block_ids] == tables
    assert len(out.block_copies) == 2 and tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3  # the partial block: one copy each but the last
    assert sched.num_forks_total == 2
    run_until_done(sched)
    assert all(len(r.output_token_ids) == 4 for r in (parent, a, b))
    assert_scheduler_drained(sched)


def test_children_run_independently_when_the_parent_cannot_be_forked():
    sched = make_scheduler(block_size=BS)
    parent, a, b = _family(sched, 3, max_tokens=1)  # the parent finishes at its first token
    run_until_done(sched)
    assert sched.num_forks_total == 0
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 1 for r in (a, b))
    assert_scheduler_drained(sched)


def test_aborting_a_waiting_child_or_the_parent_before_the_fork():
    sched = make_scheduler(block_size=BS)
    parent, a, b = _family(sched, 3)
    sched.finish_requests(["s1"], RequestStatus.FINISHED_ABORTED)
    assert sched.fork_waiting == {"s0": [b]}
    run_fake_step(sched)
    sched.finish_requests(["s0"], RequestStatus.FINISHED_ABORTED)
    outs = run_until_done(sched)
    assert outs[0].requests == [b] and outs[0].block_table_reset == [True]  # now independent
    assert len(b.output_token_ids) == 4 and not sched.fork_waiting
    assert_scheduler_drained(sched)


def test_forks_off_queues_every_sample():
    sched = make_scheduler(block_size=BS)
    sched.config = replace(sched.config, fork_parallel_samples=False)
    _family(sched, 3)
    assert not sched.fork_waiting and len(sched.waiting) == 3
    run_until_done(sched)
    assert sched.num_forks_total == 0
    assert_scheduler_drained(sched)


def test_kv_view_follows_copy_on_write_replacements():
    from engine.core.kv_view import BlockTableCopies, take_snapshot

    sched = make_scheduler(block_size=BS)
    kv, tables = sched.kv_cache_manager, BlockTableCopies()
    _family(sched, 3, max_tokens=6)
    while sched.has_unfinished_requests():
        run_fake_step(sched)
        snap = take_snapshot(sched, tables=tables)  # incremental copies, as the playground's
        for r in snap.requests:
            assert list(r.block_table) == kv.get_block_ids(r.request_id)
    assert sched.num_forks_total == 2 and kv.num_cow_copies_total == 2
