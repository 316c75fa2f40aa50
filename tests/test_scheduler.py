"""Scheduler with a null model runner: budget, max_num_seqs, chunking, preemption, abort."""

from __future__ import annotations

import pytest
from conftest import make_request, make_scheduler, run_fake_step

from engine.request import RequestStatus


def test_budget_and_max_num_seqs_hold_every_step():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(6):
        s.add_request(make_request(str(i), 9, max_tokens=4, start=100 * i))
    while s.has_unfinished_requests():
        out, _ = run_fake_step(s)
        assert out.total_num_scheduled_tokens <= 20
        assert len(out.requests) <= 3 and len(s.running) <= 3
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_long_prompt_is_chunked_and_completes():
    s = make_scheduler(max_num_batched_tokens=8)
    req = make_request("long", 30, max_tokens=2)
    s.add_request(req)
    chunks = []
    while s.has_unfinished_requests():
        out, _ = run_fake_step(s)
        chunks.append(out.num_scheduled_tokens[0])
    assert chunks == [8, 8, 8, 6, 1]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2


def test_preempts_the_last_admitted_and_resumes_it():
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12, start=50)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    while s.has_unfinished_requests():
        out, _ = run_fake_step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "b"
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert s.num_preemptions_total == len(preempted)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_abort_frees_everything(when):
    s = make_scheduler()
    req = make_request("x", 10, max_tokens=50)
    s.add_request(req)
    if when == "running":
        run_fake_step(s)
        assert req.status == RequestStatus.RUNNING
    s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and req.finish_reason == "abort"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_never_fitting_request_is_rejected():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="can never run"):
        s.add_request(make_request("huge", 20, max_tokens=10))
    with pytest.raises(ValueError, match="maximum context length is 256"):
        s.add_request(make_request("long", 250, max_tokens=10))
    assert not s.has_unfinished_requests()
