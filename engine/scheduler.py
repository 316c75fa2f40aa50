"""Continuous batching under a token budget, vLLM V1 rules (no torch).

There is no prefill or decode phase: each request's num_computed_tokens catches up with its
num_tokens, so chunked prefill and resume-after-preemption are the same path.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's batch, in execution order. Lists are parallel to `requests`."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    block_ids: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_new_requests: int = 0  # admitted from the waiting queue this step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0

    # ---- queue -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Reject what could never run, instead of queueing it to livelock."""
        max_tokens = request.sampling_params.max_tokens or 0
        total = request.num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({request.num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion."
            )
        needed = cdiv(min(total, self.max_model_len), self.config.block_size)
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The request needs {needed} KV cache blocks but the whole pool has "
                f"{self.kv_cache_manager.num_blocks}; it can never run. Reduce the prompt or "
                "max_tokens, or start the server with a larger KV cache."
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            req.num_computed_tokens += n
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while self.kv_cache_manager.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    return budget
            self._add_to_batch(out, req, num_new, req.num_computed_tokens)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv_cache_manager.allocate_slots(req, num_new, hits, num_hit_tokens) is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._add_to_batch(out, req, num_new, num_hit_tokens)
            out.num_new_requests += 1
            budget -= num_new

    def _add_to_batch(self, out: SchedulerOutput, req: Request, num_new: int, computed: int):
        out.requests.append(req)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(computed)
        out.block_ids.append(self.kv_cache_manager.get_block_ids(req.request_id))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, resume later as an ordinary prefill."""
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions_total += 1
        logger.info(
            "preempted request %s (%d tokens); %d running, %d waiting",
            req.request_id,
            req.num_tokens,
            len(self.running),
            len(self.waiting),
        )

    # ---- update ------------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply stop rules, free finished requests.

        Returns (request, new token ids) for every request that produced a token or finished.
        """
        results = []
        now = time.monotonic()
        for req, token_id in zip(out.requests, runner_output.sampled_token_ids):
            if token_id is None or req.finished:  # partial prefill chunk: nothing sampled
                continue
            req.append_output_token(token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            if self._check_stop(req, token_id):
                self._finish(req)
            results.append((req, [token_id]))
        return results

    def _check_stop(self, req: Request, token_id: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= (params.max_tokens or self.max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if not params.ignore_eos and token_id == req.eos_token_id:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if token_id in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token_id
            return True
        return False

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests in any state; their blocks are freed now."""
        finished = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._finish(req)
            finished.append(req)
        return finished

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
