"""What one scheduler step hands the runner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.spec_decode.ngram import SpecDecodeStats


@dataclass
class SchedulerOutput:
    """One step's batch, in execution order. Lists are parallel to `requests`.

    Block ids are a delta the runner applies to its own copy of each block table: the table
    starts over from `new_block_ids[i]` where `block_table_reset[i]` (first admission, or
    readmission after preemption), otherwise `new_block_ids[i]` (often empty) is appended.
    The tuples are the scheduler's snapshot of this step, never its live lists.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    new_block_ids: list[tuple[int, ...]] = field(default_factory=list)  # allocated this step
    block_table_reset: list[bool] = field(default_factory=list)  # True: the table starts over
    # Models with several KV cache groups: per request, groups 1.. in order, the same delta as
    # new_block_ids (which is group 0's). Empty for one group.
    group_new_block_ids: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_new_requests: int = 0  # admitted from the waiting queue this step
    finished_req_ids: list[str] = field(default_factory=list)  # finished since the last step
    # request id -> draft tokens scheduled after its newest token (speculative decoding): the
    # request's num_scheduled_tokens is 1 + len(drafts)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_stats: SpecDecodeStats | None = None  # filled by update_from_output when drafts ran
    # (src, dst) KV block copies (copy-on-write after a fork) the runner runs before the
    # forward pass, all read before any is written; every dst appears once.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The second KV tier (engine/core/kv_tier.py): (block id, key) of blocks evicted this step,
    # to snapshot before anything writes KV, and of blocks to fill from the tier.
    kv_stores: list[tuple[int, bytes]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests
