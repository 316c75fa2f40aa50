"""Persistent block-table rows of the model runner: incremental copy, preemption, reuse."""

from __future__ import annotations

from conftest import make_request

from engine.core.scheduler import SchedulerOutput
from engine.runner.model_runner import BlockTables


def _out(reqs, new_block_ids, resets=None) -> SchedulerOutput:
    return SchedulerOutput(
        requests=reqs,
        num_scheduled_tokens=[1] * len(reqs),
        num_computed_tokens=[0] * len(reqs),
        new_block_ids=[tuple(ids) for ids in new_block_ids],
        block_table_reset=resets or [True] * len(reqs),
    )


def test_rows_grow_incrementally_and_follow_batch_order():
    tables = BlockTables(max_blocks_per_seq=8, num_rows=2)
    a, b = make_request("a", 4), make_request("b", 4)
    rows = tables.update(_out([a, b], [[3], [5, 6]]))
    rows2 = tables.update(_out([b, a], [[], [9]], [False, False]))  # a got block 9 this step
    assert rows2.tolist() == [rows[1], rows[0]]
    assert tables.table[rows[0], :2].tolist() == [3, 9]
    assert tables.table[rows[1], :2].tolist() == [5, 6]


def test_reset_after_preemption_rewrites_the_row():
    tables = BlockTables(max_blocks_per_seq=4, num_rows=1)
    a = make_request("a", 4)
    row = tables.update(_out([a], [[1, 2, 3]]))[0]
    assert tables.update(_out([a], [[7]]))[0] == row  # same request keeps its row
    assert tables.table[row, 0] == 7
    tables.update(_out([a], [[8]], [False]))
    assert tables.table[row, :2].tolist() == [7, 8]  # appended after the rewritten start


def test_released_rows_are_reused_and_table_grows_when_full():
    tables = BlockTables(max_blocks_per_seq=2, num_rows=1)
    a, b, c = make_request("a", 2), make_request("b", 2), make_request("c", 2)
    ra, rb = tables.update(_out([a, b], [[1], [2]])).tolist()
    assert tables.table.shape[0] == 2 and ra != rb
    tables.release("a")
    assert tables.update(_out([c], [[4]]))[0] == ra
    assert tables.table[ra, 0] == 4


# ---- the shared prefix of decoding sequences (the cascade decode's input) ----------------------
def _shared(rows, query_lens, seq_lens, block_size=16) -> int:
    import numpy as np

    from engine.runner.model_runner import shared_prefix_blocks

    table = np.array(rows, dtype=np.int32)
    return shared_prefix_blocks(table, np.array(query_lens), np.array(seq_lens), block_size)


def test_shared_prefix_counts_the_common_leading_blocks_of_decoding_rows():
    rows = [[4, 9, 2, 7, 0], [4, 9, 2, 8, 0], [4, 9, 5, 3, 0]]
    assert _shared(rows, [1, 1, 1], [70, 70, 70]) == 2  # the third row parts at block 2
    assert _shared(rows[:2], [1, 1], [70, 70]) == 3
    assert _shared([[4, 9], [5, 9]], [1, 1], [20, 20]) == 0  # first blocks differ


def test_shared_prefix_ignores_prefilling_rows_and_needs_two_decoding():
    rows = [[4, 9, 2, 7], [1, 1, 1, 1], [4, 9, 2, 6]]
    assert _shared(rows, [1, 30, 1], [60, 60, 60]) == 3  # the prefill row does not count
    assert _shared(rows, [1, 30, 30], [60, 60, 60]) == 0  # one decoding row: nothing shared
    assert _shared([[4, 9, 2, 7]], [1], [60]) == 0


def test_shared_prefix_stops_before_each_rows_newest_token():
    # identical rows, but the shortest sequence's newest token (position 32) is in block 2, and
    # at 33 tokens blocks 0-1 are full: 2 shared; at 32 tokens block 1 holds the newest token.
    rows = [[4, 9, 2, 7], [4, 9, 2, 7]]
    assert _shared(rows, [1, 1], [33, 60]) == 2
    assert _shared(rows, [1, 1], [32, 60]) == 1
    assert _shared(rows, [1, 1], [1, 60]) == 0


# ---- driven by the real scheduler: deltas only, rows rewritten after preemption ----------------
def test_block_tables_follow_the_scheduler_through_preemption_and_readmission():
    from conftest import make_scheduler

    from engine.outputs import ModelRunnerOutput

    s = make_scheduler(num_blocks=9, block_size=4, enable_prefix_caching=False)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 8, max_tokens=12, start=50 * i))
    tables = BlockTables(max_blocks_per_seq=8, num_rows=4)
    num_readmitted = 0
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for rid in out.finished_req_ids:  # what ModelRunner.execute does first
            tables.release(rid)
        rows = tables.update(out)
        for req, row, reset in zip(out.requests, rows, out.block_table_reset):
            ids = s.kv_cache_manager.get_block_ids(req.request_id)
            assert tables.table[row, : len(ids)].tolist() == ids, req.request_id
            assert tables.num_filled[req.request_id] == len(ids)  # nothing stale past the end
            num_readmitted += reset and req.num_preemptions > 0
        sampled = [
            7 if c + n == r.num_tokens else None
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ]
        s.update_from_output(out, ModelRunnerOutput(sampled))
    assert num_readmitted > 0 and not s.has_unfinished_requests()
    for rid in s.schedule().finished_req_ids:
        tables.release(rid)
    assert not tables.row_of and len(tables.free_rows) == tables.table.shape[0]


# ---- the engine: finished_req_ids, not the output path, release runner state -----------------
def test_runner_state_is_released_from_the_schedulers_finished_ids(tiny_model_dir):
    from conftest import run_engine

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4))
    released = []
    sampler_release = engine.runner.sampler.release
    engine.runner.sampler.release = lambda rid: (released.append(rid), sampler_release(rid))
    greedy = dict(temperature=0.0, ignore_eos=True)
    run_engine(
        engine,
        {
            "short": ([5, 6, 7], SamplingParams(max_tokens=2, **greedy)),
            "long": ([8, 9], SamplingParams(max_tokens=5, **greedy)),
        },
    )
    # "short" finished first and was released on the next step; "long" finished on the last
    # step, so it keeps its row until a step hands its id to the runner.
    assert released == ["short"]
    assert list(engine.runner.block_tables.row_of) == ["long"]
    engine.step()  # an idle step still carries finished_req_ids to the runner
    assert released == ["short", "long"] and not engine.runner.block_tables.row_of
