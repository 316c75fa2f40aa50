"""Persistent block-table rows of the model runner: incremental copy, preemption, reuse."""

from __future__ import annotations

from conftest import make_request

from engine.model_runner import BlockTables
from engine.scheduler import SchedulerOutput


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

    from engine.model_runner import shared_prefix_blocks

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
