"""Continuous batching under a token budget, vLLM V1 rules (no torch).

There is no prefill or decode phase: each request's num_computed_tokens catches up with its
num_tokens, so chunked prefill and resume-after-preemption are the same path. A step costs
O(scheduled requests): a decode step that allocates no block hands the runner a shared empty
tuple, the waiting queue removes in O(1), and the running list is compacted once per step, never
searched per finished request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from engine.config import EngineConfig
from engine.core.admission import check_fits
from engine.core.block_pool import KVCacheBlock
from engine.core.encoder_budget import EncoderBudget
from engine.core.forks import drop_fork_waiting, fork_ready, hold_for_fork
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_swap import LOADING, WAIT, KVSwap
from engine.core.kv_tier import KVTier
from engine.core.pooling import finish_pooled
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue
from engine.core.scheduler_output import SchedulerOutput
from engine.outputs import ModelRunnerOutput
from engine.spec_decode.ngram import NgramProposer, SpecDecodeStats

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_NO_NEW_BLOCKS: tuple[int, ...] = ()


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_blocks: int, group_windows: tuple[int, ...] = (0,)
    ) -> None:
        """group_windows: the model's KV cache groups, 0 for full attention, W for a sliding
        window (ModelRunner.kv_cache_spec.windows); the default is one full-attention group."""
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            group_windows,
            config.max_num_batched_tokens,
            getattr(config, "prefix_caching_hash_algo", "builtin"),
        )
        # Sliding groups return blocks on steps that allocate nothing, and several groups need
        # a delta each: such models call allocate_slots every step.
        self.is_hybrid = self.kv_cache_manager.is_hybrid
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.finished_req_ids: list[str] = []
        self.num_preemptions_total = 0
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        if self.proposer is not None and self.is_hybrid:
            raise ValueError(
                "speculative_config is not supported with sliding-window KV cache groups yet"
            )
        # Requests whose rejected drafts gave blocks back: their next step resends the table.
        self._tables_to_reset: set[str] = set()
        # Parallel samples (n > 1) wait here, by the id of the sibling that prefills the prompt,
        # to be forked from it once its prompt is computed (engine/core/forks.py).
        self.fork_waiting: dict[str, list[Request]] = {}
        self.num_forks_total = 0
        self.encoder_budget = EncoderBudget(config.encoder_budget_tokens)  # images per step
        self.kv_tier: KVTier | None = None  # the second KV tier (engine/kv_offload/setup.py)
        self.kv_swap: KVSwap | None = None  # swap preemption through it (engine/core/kv_swap.py)

    # ---- queue -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request that passed check_fits (LLMEngine.make_request calls it once)."""
        self.requests[request.request_id] = request
        if request.fork_parent_id is not None and hold_for_fork(self, request):
            return
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Reject what could never run, instead of queueing it to livelock
        (engine/core/admission.py: the one context-length and never-fits check)."""
        check_fits(self, request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.fork_waiting or self.kv_tier_loading)

    @property
    def kv_tier_loading(self) -> bool:
        return self.kv_tier is not None and bool(self.kv_tier.loading or self.kv_swap.num_loading)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = []
        self.encoder_budget.new_step()
        if self.fork_waiting:
            fork_ready(self)
        if self.kv_tier is not None:  # requests whose tier blocks are loaded run again
            ready = self.kv_swap.finish_loads() + self.kv_tier.finish_loads()
            for req in reversed(ready):
                self.waiting.appendleft(req)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # a step that preempted has no room to admit anyone
            self._schedule_waiting(out, budget)
        if self.kv_cache_manager.pending_copies:
            out.block_copies = self.kv_cache_manager.take_block_copies()
        if self.kv_tier is not None:
            out.kv_stores = self.kv_tier.take_stores() + self.kv_swap.take_stores()
            out.kv_loads = self.kv_tier.take_loads() + self.kv_swap.take_loads()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Each running request gets min(tokens owed, budget left, max_model_len cap).

        The hot loop of a decode step, so it binds its lookups locally and leaves the named
        steps to the requests that need them: drafts (_propose), new KV blocks or a KV group
        delta, with preemption when the pool is full (_allocate_running), and a block table
        sent anew after rejected drafts gave blocks back (_take_table_reset). It calls
        allocate_slots only when a new block is needed or a block fills up this step and must
        be cached (15 of 16 decode steps at block_size 16 need neither).
        """
        running, bs, max_model_len = self.running, self.block_size, self.max_model_len
        kv = self.kv_cache_manager
        get_block_ids, cow = kv.get_block_ids, kv.cow_requests  # cow: forked, may copy first
        batch, num_scheduled = out.requests, out.num_scheduled_tokens
        num_computed, new_block_ids = out.num_computed_tokens, out.new_block_ids
        resets = out.block_table_reset
        hybrid = self.is_hybrid
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            computed = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) - computed, budget, max_model_len - computed)
            if num_new <= 0 or (  # images: this step's encoder budget may stop the chunk short
                req.mm_inputs and (num_new := self.encoder_budget.clip(req, computed, num_new)) <= 0
            ):
                continue
            drafts = self._propose(req, budget) if self.proposer is not None else None
            if drafts:
                num_new += len(drafts)
            end = computed + num_new
            new_ids = _NO_NEW_BLOCKS
            if (
                hybrid
                or end > len(get_block_ids(req.request_id)) * bs
                or end // bs != computed // bs
                or (cow and req.request_id in cow)
            ):
                granted = self._allocate_running(req, num_new, drafts, out)
                if granted is None:  # req itself was preempted
                    break
                num_new, drafts, new_ids = granted
                end = computed + num_new
            new_ids, reset = self._table_delta(req, out, new_ids)
            if drafts:
                out.spec_token_ids[req.request_id] = drafts
            batch.append(req)
            num_scheduled.append(num_new)
            num_computed.append(computed)
            new_block_ids.append(new_ids)
            resets.append(reset)
            req.num_computed_tokens = end
            budget -= num_new
        return budget

    def _allocate_running(
        self, req: Request, num_new: int, drafts: list[int] | None, out: SchedulerOutput
    ) -> tuple[int, list[int] | None, tuple[int, ...]] | None:
        """KV slots for a running request's step: (num_new, drafts, group 0's new block ids).

        Drafts never preempt anyone: when the pool is short they are dropped and the request
        asks for its one token; if even that does not fit, requests are preempted from the
        back of `running` (None: req itself was). With several KV groups, groups 1.. get
        their deltas appended to the output.
        """
        kv = self.kv_cache_manager
        if self.is_hybrid:
            num_before = self._num_table_entries(req.request_id)
        new_blocks = kv.allocate_slots(req, num_new)
        if new_blocks is None and drafts:
            num_new, drafts = 1, None
            new_blocks = kv.allocate_slots(req, num_new)
        if new_blocks is None:
            new_blocks = self._preempt_until_fits(req, num_new, out)
            if new_blocks is None:
                return None
        if self.is_hybrid:
            return num_new, drafts, self._add_group_deltas(out, req.request_id, num_before)
        if new_blocks:
            return num_new, drafts, tuple([b.block_id for b in new_blocks])
        return num_new, drafts, _NO_NEW_BLOCKS

    def _table_delta(
        self, req: Request, out: SchedulerOutput, new_ids: tuple[int, ...]
    ) -> tuple[tuple[int, ...], bool]:
        """(block ids, reset) for the runner: the whole table (reset) where rejected drafts gave
        blocks back, the request was just forked, or copies replaced entries of its table."""
        kv, rid = self.kv_cache_manager, req.request_id
        if (kv.replaced_tables and kv.take_replaced_table(rid)) or (
            self._tables_to_reset and rid in self._tables_to_reset
        ):
            return self._take_table_reset(req, out), True
        return new_ids, False

    def _take_table_reset(self, req: Request, out: SchedulerOutput) -> tuple[int, ...]:
        """The whole block table of a request whose rejected drafts gave blocks back, that was
        just forked, or whose entries were replaced by copies (with several groups, their
        whole tables replace the deltas _allocate_running appended)."""
        kv = self.kv_cache_manager
        self._tables_to_reset.discard(req.request_id)
        if self.is_hybrid:
            out.group_new_block_ids[-1] = tuple(
                tuple(kv.get_block_ids(req.request_id, g)) for g in range(1, kv.num_groups)
            )
        return tuple(kv.get_block_ids(req.request_id))

    def _propose(self, req: Request, budget: int) -> list[int] | None:
        """Draft tokens for a decoding request, capped so that every draft accepted plus the
        bonus token never pass max_tokens or max_model_len, nor the step's token budget."""
        num_tokens = len(req.all_token_ids)
        if req.num_computed_tokens != num_tokens - 1 or req.grammar is not None:
            return None
        params = req.sampling_params
        max_tokens = params.max_tokens or self.max_model_len
        max_drafts = min(
            budget - 1,
            self.max_model_len - num_tokens - 1,
            max_tokens - (num_tokens - req.num_prompt_tokens) - 1,
        )
        if max_drafts <= 0:
            return None
        return self.proposer.propose(req.all_token_ids, max_drafts) or None

    def _num_table_entries(self, request_id: str) -> list[int]:
        kv = self.kv_cache_manager
        return [len(kv.get_block_ids(request_id, g)) for g in range(kv.num_groups)]

    def _add_group_deltas(self, out: SchedulerOutput, request_id: str, num_before: list[int]):
        """Group 0's new ids (returned) and the other groups' (appended to the output)."""
        kv = self.kv_cache_manager
        deltas = [tuple(kv.get_block_ids(request_id, g)[n:]) for g, n in enumerate(num_before)]
        out.group_new_block_ids.append(tuple(deltas[1:]))
        return deltas[0]

    def _preempt_until_fits(
        self, req: Request, num_new: int, out: SchedulerOutput
    ) -> list[KVCacheBlock] | None:
        """Preempt from the back of `running` until req fits: its new blocks, None if it went."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return None
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            if new_blocks is not None:
                return new_blocks

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """FCFS admission: the head of the queue is never overtaken, so nobody starves."""
        kv = self.kv_cache_manager
        now = time.monotonic()
        seats = len(self.running) + sum(r.extra_seats for r in self.running)  # beam groups'
        if self.kv_swap is not None and self.kv_swap.entries:
            self.kv_swap.keep_ready_first(self.waiting)
        while self.waiting and budget > 0 and seats < self.max_num_seqs:
            req = self.waiting.peek()
            if seats + req.extra_seats >= self.max_num_seqs:
                break  # a beam group waits until its width fits
            if req.lora_request is not None and not self._lora_fits(req):
                break  # --max-loras adapters run already: the head waits its turn (FCFS)
            looked_up = self._look_up(req)
            if looked_up is LOADING:
                self.waiting.popleft()  # back at the front once its tier blocks are loaded
                continue
            if looked_up is WAIT:
                break
            hits, num_hit_tokens = looked_up
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            num_new = self.encoder_budget.clip(req, num_hit_tokens, num_new, commit=False)
            if num_new <= 0 or kv.allocate_slots(req, num_new, hits, num_hit_tokens) is None:
                break
            if self.kv_swap is not None and req.request_id in self.kv_swap.entries:
                self.kv_swap.resumed(req, num_new)  # swapped back in: resumes where it stopped
            self.encoder_budget.clip(req, num_hit_tokens, num_new)  # admitted: charge it
            self.waiting.popleft()
            self.running.append(req)
            seats += 1 + req.extra_seats
            req.status = _RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._add_to_batch(out, req, num_new, num_hit_tokens)
            out.num_new_requests += 1
            budget -= num_new

    def _look_up(self, req: Request):
        """(hit blocks, hit tokens) of a waiting request: its prefix-cache hit, or its swapped
        blocks; LOADING when it leaves the queue for tier or swap loads; WAIT to stay the head."""
        if self.kv_swap is not None and req.request_id in self.kv_swap.entries:
            return self.kv_swap.resume(req)
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req)
        if self.kv_tier is not None and self.kv_tier.start_load(req, num_hit_tokens):
            return LOADING
        return hits, num_hit_tokens

    def _lora_fits(self, req: Request) -> bool:
        """Whether req's LoRA adapter may join the running ones (at most --max-loras)."""
        running = {r.lora_request.content_hash for r in self.running if r.lora_request}
        return req.lora_request.content_hash in running or len(running) < self.config.max_loras

    def _add_to_batch(self, out: SchedulerOutput, req: Request, num_new: int, computed: int):
        out.requests.append(req)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(computed)
        # Waiting requests hold no blocks, so what they hold now is their whole new table.
        kv = self.kv_cache_manager
        out.new_block_ids.append(tuple(kv.get_block_ids(req.request_id)))
        if self.is_hybrid:
            tables = [tuple(kv.get_block_ids(req.request_id, g)) for g in range(1, kv.num_groups)]
            out.group_new_block_ids.append(tuple(tables))
        out.block_table_reset.append(True)
        req.num_computed_tokens = computed + num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Drop the KV and resume later as an ordinary prefill (recompute), or first copy it to
        the KV tier and resume from there (swap: engine/core/kv_swap.py has the rule)."""
        if self.kv_swap is not None:
            self.kv_swap.swap_out(req)
        self.kv_cache_manager.free(req)  # reverse order; cached blocks stay for its own resume
        self._tables_to_reset.discard(req.request_id)  # readmission resends the table anyway
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions_total += 1
        logger.info(
            "preempted request %s (%d tokens, preemption %d); %d running, %d waiting, %d total",
            req.request_id,
            req.num_tokens,
            req.num_preemptions,
            len(self.running),
            len(self.waiting),
            self.num_preemptions_total,
        )

    # ---- update ------------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply stop rules, free finished requests.

        Returns (request, new token ids) for every request that produced a token or finished.
        """
        results = []
        num_finished = 0
        now = time.monotonic()
        check_stop = self._check_stop
        spec = out.spec_token_ids
        if spec:
            out.spec_stats = SpecDecodeStats.empty(self.proposer.k)
        for req, token_id in zip(out.requests, runner_output.sampled_token_ids):
            if token_id is None or req.status is not _RUNNING:  # partial chunk, or aborted
                continue
            if spec and req.request_id in spec:
                tokens = runner_output.spec_token_ids[req.request_id]
                kept = self._append_verified(req, spec[req.request_id], tokens, out.spec_stats)
                num_finished += req.status is not _RUNNING
                results.append((req, kept))
                continue
            req.all_token_ids.append(token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            if check_stop(req, token_id):
                self._free_finished(req)
                num_finished += 1
            results.append((req, [token_id]))
        if runner_output.pooler_output:  # pooling requests whose prompt is computed
            num_finished += finish_pooled(self, runner_output.pooler_output, results)
        if num_finished:  # one pass per step instead of a list.remove per finished request
            self.running = [r for r in self.running if r.status is _RUNNING]
        return results

    def _append_verified(
        self, req: Request, drafts: list[int], tokens: list[int], stats: SpecDecodeStats
    ) -> list[int]:
        """Appends the accepted drafts and the bonus token one at a time with the stop rules of
        plain decoding (tokens after a stop are dropped); gives back the rejected drafts' KV.
        Returns the tokens appended."""
        stats.record(len(drafts), len(tokens) - 1)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for i, token_id in enumerate(tokens):
            req.all_token_ids.append(token_id)
            if self._check_stop(req, token_id):
                self._free_finished(req)
                return tokens[: i + 1]
        # KV is valid up to the last accepted draft; the bonus token has none yet.
        num_computed = len(req.all_token_ids) - 1
        if num_computed < req.num_computed_tokens:
            req.num_computed_tokens = num_computed
            if self.kv_cache_manager.rollback(req, num_computed):
                self._tables_to_reset.add(req.request_id)
        return tokens

    def _check_stop(self, req: Request, token_id: int) -> bool:
        """Length first (as vLLM), then EOS and stop token ids once min_tokens is reached."""
        params = req.sampling_params
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        if num_output >= (params.max_tokens or self.max_model_len) or (
            num_tokens >= self.max_model_len
        ):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if num_output < params.min_tokens:  # min_tokens holds EOS and stop tokens back
            return False
        if not params.ignore_eos and (
            token_id == req.eos_token_id or token_id in req.eos_token_ids
        ):
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and token_id in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token_id
            return True
        return False

    def finish_by_stop_string(self, req: Request, stop_str: str, num_dropped: int = 0) -> None:
        """A stop string completed in the request's text (the detokenizer saw it this step).

        It wins over a length or token stop decided in the same step (as in vLLM); a request
        still running is finished and its blocks are freed now. num_dropped: tokens of this
        step after the one that completed it (accepted drafts), taken off the request.
        """
        if num_dropped:
            del req.all_token_ids[len(req.all_token_ids) - num_dropped :]
        if req.finished:  # stopped in update_from_output: its blocks are already free
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        req.stop_reason = stop_str

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests in any state; their blocks are freed now."""
        finished = []
        num_running = 0
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if req.status is _RUNNING:
                num_running += 1
            elif req in self.waiting:  # waiting or preempted
                self.waiting.remove(req)
            elif self.kv_tier is not None and (
                self.kv_tier.drop(req) or self.kv_swap.is_loading(req)
            ):
                pass  # waiting for tier or swap loads: its blocks go when they land
            else:  # a parallel sample waiting for its fork
                drop_fork_waiting(self, req)
            req.status = status
            self._free_finished(req)
            finished.append(req)
        if num_running:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return finished

    def _free_finished(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        if self.kv_tier is not None:
            self.kv_tier.forget(req.request_id)
            self.kv_swap.drop(req)
        self._tables_to_reset.discard(req.request_id)
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)
