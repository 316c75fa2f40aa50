"""Scheduler with a null model runner: budget, max_num_seqs, chunking, preemption, abort, stops."""

from __future__ import annotations

import logging

import pytest
from conftest import (
    assert_scheduler_drained,
    make_request,
    make_scheduler,
    run_fake_step,
    run_until_done,
)

from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams

EOS = 2


# ---- budget, max_num_seqs, chunked prefill ---------------------------------------------------
@pytest.mark.parametrize("budget", [5, 20, 64])
def test_budget_and_max_num_seqs_hold_every_step(budget):
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=budget, num_blocks=48)
    for i in range(8):
        s.add_request(make_request(str(i), 5 + 3 * i, max_tokens=4, start=100 * i))
    for out in run_until_done(s):
        assert sum(out.num_scheduled_tokens) <= budget
        assert len(out.requests) <= 3 and len(s.running) <= 3
        for req, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
            assert 0 < n <= req.num_tokens - c  # never more than the tokens owed
    assert_scheduler_drained(s)


def test_default_budget_is_512_tokens_on_cpu_and_2048_on_gpu():
    from engine.config import EngineConfig
    from server.cli import build_parser

    assert EngineConfig(device="cpu").max_num_batched_tokens == 512
    assert EngineConfig(device="cuda").max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=2048).max_num_batched_tokens == 2048
    _, serve = build_parser()  # the flag leaves the choice to the engine unless given
    assert serve.parse_args([]).max_num_batched_tokens is None
    assert serve.parse_args(["--max-num-batched-tokens", "96"]).max_num_batched_tokens == 96


def test_long_prompt_is_chunked_and_completes():
    s = make_scheduler(max_num_batched_tokens=8)
    req = make_request("long", 30, max_tokens=2)
    s.add_request(req)
    chunks = [out.num_scheduled_tokens[0] for out in run_until_done(s)]
    assert chunks == [8, 8, 8, 6, 1]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2
    assert_scheduler_drained(s)


def test_running_requests_come_first_and_waiting_take_the_rest():
    s = make_scheduler(max_num_batched_tokens=10)
    a = make_request("a", 4, max_tokens=20)
    s.add_request(a)
    run_fake_step(s)  # a: prefill, now decoding
    s.add_request(make_request("b", 30, max_tokens=2, start=100))
    out, _ = run_fake_step(s)
    # a owes 1 token and gets it first; b's prompt is chunked into the 9 left.
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 9]


def test_max_model_len_caps_and_finishes_a_request():
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=64)
    req = make_request("x", 10, max_tokens=None)
    s.add_request(req)
    outs = run_until_done(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.finish_reason == "length"
    assert req.num_tokens == 16 and req.num_output_tokens == 6
    assert (
        max(
            c + n for out in outs for c, n in zip(out.num_computed_tokens, out.num_scheduled_tokens)
        )
        <= 16
    )
    assert_scheduler_drained(s)


# ---- preemption ------------------------------------------------------------------------------
def test_preempts_the_last_admitted_first_and_counts_and_logs(caplog):
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(n, 8, max_tokens=12, start=50 * i) for i, n in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    preempted = []
    with caplog.at_level(logging.INFO, logger="engine.core.scheduler"):
        for out in run_until_done(s):
            preempted += [r.request_id for r in out.preempted]
            if out.preempted:
                assert out.num_new_requests == 0  # no admissions in a step that preempted
    assert preempted[:2] == ["c", "b"]  # last admitted goes first
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert s.num_preemptions_total == len(preempted) == sum(r.num_preemptions for r in reqs)
    logs = [r for r in caplog.records if "preempted request" in r.getMessage()]
    assert len(logs) == len(preempted)
    assert_scheduler_drained(s)


def test_no_admission_in_a_step_that_preempted():
    # Without prefix caching a preempted request could come straight back as a small chunk and
    # be preempted again next step: admitting nothing in a preempting step stops the ping-pong.
    s = make_scheduler(
        num_blocks=6,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=4,
        enable_prefix_caching=False,
    )
    s.add_request(make_request("a", 4, max_tokens=16))
    s.add_request(make_request("b", 16, max_tokens=2, start=100))
    outs = run_until_done(s)
    preempting = [o for o in outs if o.preempted]
    assert preempting and all(o.num_new_requests == 0 for o in preempting)
    assert all(o.preempted[0] not in o.requests for o in preempting)
    assert_scheduler_drained(s)


def test_preempted_request_goes_back_to_the_front_of_the_queue():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12, start=50)
    late = make_request("late", 4, max_tokens=2, start=200)
    for r in (a, b, late):
        s.add_request(r)
    for _ in range(100):
        if s.num_preemptions_total:
            break
        run_fake_step(s)
    assert [r.request_id for r in s.waiting] == ["b", "late"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_request_resumes_as_a_prefill_on_its_own_cached_blocks(caching):
    s = make_scheduler(num_blocks=10, block_size=4, enable_prefix_caching=caching)
    a = make_request("a", 12, max_tokens=16)
    b = make_request("b", 12, max_tokens=16, start=100)
    s.add_request(a)
    s.add_request(b)
    resumed_from = None
    for _ in range(200):
        out, _ = run_fake_step(s)
        for req, c in zip(out.requests, out.num_computed_tokens):
            if req is b and b.num_preemptions and resumed_from is None:
                resumed_from = c  # the resume step: computed tokens before it = prefix hit
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert b.num_output_tokens == a.num_output_tokens == 16
    if caching:
        assert resumed_from >= 12  # at least its whole prompt came back from the cache
    else:
        assert resumed_from == 0
    assert_scheduler_drained(s)


def test_blocks_filled_during_decode_are_cached():
    # Decode steps skip allocate_slots when no block is needed: full blocks must still be cached.
    s = make_scheduler(block_size=4)
    first = make_request("first", 6, max_tokens=11)
    s.add_request(first)
    run_until_done(s)  # 17 tokens, 16 of them computed: the last block filled on the last step
    again = Request("again", first.all_token_ids, SamplingParams(max_tokens=1))
    s.add_request(again)
    out, _ = run_fake_step(s)
    assert out.num_computed_tokens == [16]  # 4 full blocks, three of them written by decode


# ---- fairness --------------------------------------------------------------------------------
def test_fcfs_no_request_starves_under_constant_load():
    # One new request per step, more than the batch can serve, in a pool that forces preemption.
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    reqs, finished_at = [], {}
    for step in range(400):
        req = make_request(str(step), 6 + step % 5, max_tokens=5, start=1000 * step)
        reqs.append(req)
        s.add_request(req)
        _, results = run_fake_step(s)
        for r, _ in results:
            if r.finished:
                finished_at[r.request_id] = step
    assert s.num_preemptions_total > 0 and len(s.waiting) > 100  # really overloaded
    served = [r for r in reqs if r.request_id in finished_at]
    # Served strictly in arrival order: a finished request never has an unfinished elder.
    assert reqs[: len(served)] == served
    # And each one within a bound linear in its position in the line.
    for i, r in enumerate(served):
        assert finished_at[r.request_id] <= 2 * i + 10
    assert len(served) > 100


# ---- abort -----------------------------------------------------------------------------------
def _preempted_victim(s):
    a, b = make_request("a", 8, max_tokens=12), make_request("x", 8, max_tokens=12, start=50)
    s.add_request(a)
    s.add_request(b)
    for _ in range(100):
        if b.status == RequestStatus.PREEMPTED:
            return b
        run_fake_step(s)
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_each_state_frees_everything(state):
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    if state == "preempted":
        s = make_scheduler(num_blocks=6, block_size=4)
        req = _preempted_victim(s)
    else:
        req = make_request("x", 10, max_tokens=50)
        s.add_request(req)
        steps = {"waiting": 0, "prefilling": 1, "decoding": 3}[state]
        for _ in range(steps):
            run_fake_step(s)
        assert (req.num_computed_tokens, req.num_output_tokens) == {
            "waiting": (0, 0),
            "prefilling": (4, 0),
            "decoding": (10, 1),
        }[state]
    aborted = s.finish_requests(["x", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert aborted == [req] and req.finish_reason == "abort"
    assert req not in s.running and req not in s.waiting
    assert s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    out = run_until_done(s)
    assert all(req not in o.requests for o in out)
    assert out == [] or "x" in out[0].finished_req_ids
    assert_scheduler_drained(s)


def test_abort_between_schedule_and_update_drops_the_token():
    s = make_scheduler()
    req = make_request("x", 4, max_tokens=5)
    s.add_request(req)
    out = s.schedule()
    s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, ModelRunnerOutput([7])) == []
    assert req.num_output_tokens == 0
    assert_scheduler_drained(s)


# ---- admission control -----------------------------------------------------------------------
def test_never_fitting_request_is_rejected():
    # check_fits is the one admission check (LLMEngine.make_request calls it before add_request).
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="can never run"):
        s.check_fits(make_request("huge", 20, max_tokens=10))
    with pytest.raises(ValueError, match="can never run"):  # may grow to max_model_len
        s.check_fits(make_request("open", 5, max_tokens=None))
    with pytest.raises(ValueError, match="maximum context length is 256"):
        s.check_fits(make_request("long", 250, max_tokens=10))
    fits = make_request("fits", 10, max_tokens=7)  # 16 KV tokens: exactly the pool
    s.check_fits(fits)
    s.add_request(fits)
    assert len(s.waiting) == 1
    run_until_done(s)
    assert_scheduler_drained(s)


def test_prompt_over_max_model_len_is_rejected_without_max_tokens():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="your request has 17 input tokens") as e:
        s.check_fits(make_request("x", 17, max_tokens=None))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")


# ---- stop conditions -------------------------------------------------------------------------
def _eos_request(rid: str, **params):
    req = make_request(rid, 4, **params)
    req.eos_token_id = EOS
    return req


@pytest.mark.parametrize(
    "params,num_output,reason",
    [
        ({"max_tokens": 8}, 1, "stop"),
        ({"max_tokens": 8, "min_tokens": 3}, 3, "stop"),
        ({"max_tokens": 8, "ignore_eos": True}, 8, "length"),
        ({"max_tokens": 8, "min_tokens": 8}, 8, "length"),
    ],
)
def test_eos_min_tokens_and_ignore_eos(params, num_output, reason):
    s = make_scheduler()
    req = _eos_request("x", **params)
    s.add_request(req)
    run_until_done(s, token_id=EOS)
    assert (req.num_output_tokens, req.finish_reason) == (num_output, reason)
    assert_scheduler_drained(s)


def test_stop_token_ids_are_held_back_by_min_tokens():
    s = make_scheduler()
    req = _eos_request("x", max_tokens=8, min_tokens=2, stop_token_ids=[9], ignore_eos=True)
    s.add_request(req)
    run_until_done(s, token_id=9)
    assert (req.num_output_tokens, req.finish_reason, req.stop_reason) == (2, "stop", 9)


def test_request_stats_times_are_set():
    s = make_scheduler()
    req = make_request("x", 5, max_tokens=3)
    s.add_request(req)
    run_until_done(s)
    assert req.arrival_time <= req.first_scheduled_time <= req.first_token_time
    assert req.num_cached_tokens == 0


# ---- the waiting queue -----------------------------------------------------------------------
def test_request_queue_is_fcfs_with_prepend_and_remove():
    q = RequestQueue()
    a, b, c, d = (make_request(x, 1) for x in "abcd")
    for r in (a, b, c):
        q.append(r)
    q.appendleft(d)
    q.remove(b)
    assert [r.request_id for r in q] == ["d", "a", "c"] and len(q) == 3 and b not in q
    assert q.peek() is d and q.popleft() is d and q.popleft() is a and q


# ---- the contract with the model runner --------------------------------------------------------
def test_scheduler_output_block_ids_are_a_snapshot_not_live_lists():
    s = make_scheduler(block_size=4)
    req = make_request("x", 6, max_tokens=12)
    s.add_request(req)
    kv = s.kv_cache_manager
    first, _ = run_fake_step(s)
    assert first.block_table_reset == [True]  # its table starts from these ids
    assert list(first.new_block_ids[0]) == kv.get_block_ids("x")
    snapshot = list(first.new_block_ids[0])
    deltas = [(first.new_block_ids[0], True)]
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.requests == [req]
        deltas.append((out.new_block_ids[0], out.block_table_reset[0]))
        kv_table = list(kv.get_block_ids("x"))
        s.update_from_output(out, ModelRunnerOutput([7]))
    assert list(first.new_block_ids[0]) == snapshot  # growing and freeing the table left it alone
    assert len(kv_table) > len(snapshot)  # the table did grow after the first step
    rebuilt = [b for ids, _ in deltas for b in ids]
    assert rebuilt == kv_table and not any(reset for _, reset in deltas[1:])
    assert all(ids == () for ids, _ in deltas[1:] if not ids)  # no-new-block steps: empty tuples


def test_stop_string_finishes_through_the_scheduler_even_when_length_ends_it_too():
    s = make_scheduler(block_size=4)
    a = make_request("a", 6, max_tokens=10)
    b = make_request("b", 6, max_tokens=2, start=100)
    s.add_request(a)
    s.add_request(b)
    run_fake_step(s)  # both prefilled, one token each
    run_fake_step(s)  # b's second token: finished by length in update_from_output
    assert b.status == RequestStatus.FINISHED_LENGTH and a.status == RequestStatus.RUNNING
    # The detokenizer saw a stop string complete in both this step.
    s.finish_by_stop_string(a, "x")
    s.finish_by_stop_string(b, "y")
    for req, stop in ((a, "x"), (b, "y")):
        assert req.status == RequestStatus.FINISHED_STOPPED and req.finish_reason == "stop"
        assert req.stop_reason == stop and req not in s.running
        assert not s.kv_cache_manager.get_block_ids(req.request_id)
    assert s.schedule().finished_req_ids == ["b", "a"]  # the runner hears of both
    assert_scheduler_drained(s)
