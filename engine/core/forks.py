"""Parallel samples (n > 1) as copy-on-write forks of one sequence (no torch).

The n engine requests of one prompt are linked by `Request.fork_parent_id` (the sibling that
prefills the prompt). The others wait in `Scheduler.fork_waiting` until that sibling has
computed the whole prompt and sampled its first token; then each is forked from it
(KVCacheManager.fork): it shares every prompt block, the partly filled last one included, and
starts at num_computed = prompt - 1, so its first step recomputes only the last prompt token and
samples its own first token from those logits with its own sampler state (seed + i). That
one-token write lands in the shared last block, which is copied first (copy-on-write); so does
the parent's next write. A sibling that cannot be forked (the parent finished, was preempted or
went on, prompt logprobs asked, no seat left under max_num_seqs) runs as an independent request,
as every sibling did before forks (EngineConfig.fork_parallel_samples=False keeps that path).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler


def hold_for_fork(sched: Scheduler, child: Request) -> bool:
    """Parks child until its parent's prompt is computed; False: queue it as usual."""
    if not sched.config.fork_parallel_samples or child.sampling_params.prompt_logprobs is not None:
        return False
    parent = sched.requests.get(child.fork_parent_id)
    if parent is None or parent.finished or parent.num_output_tokens:
        return False
    if parent.all_token_ids != child.all_token_ids or parent.cache_salt != child.cache_salt:
        return False
    if parent.mm_spans != child.mm_spans or parent.lora_request != child.lora_request:
        return False
    sched.fork_waiting.setdefault(parent.request_id, []).append(child)
    return True


def fork_ready(sched: Scheduler) -> None:
    """At the start of a step: forks the children whose parent just sampled its first token,
    releases those whose parent can no longer be forked, and leaves the rest waiting."""
    for parent_id in list(sched.fork_waiting):
        parent = sched.requests.get(parent_id)
        if parent is not None and not parent.finished and not parent.num_output_tokens:
            continue  # still waiting or prefilling (perhaps after a preemption)
        children = sched.fork_waiting.pop(parent_id)
        if (
            parent is not None
            and parent.status is RequestStatus.RUNNING
            and parent.num_output_tokens == 1
            and parent.num_computed_tokens == parent.num_prompt_tokens
        ):
            held = len(sched.running) + sum(r.extra_seats for r in sched.running)  # beams'
            seats = max(sched.max_num_seqs - held, 0)
            for child in children[:seats]:
                _fork(sched, parent, child)
            children = children[seats:]
        for child in reversed(children):  # independent requests, ahead of later arrivals
            sched.waiting.appendleft(child)


def _fork(sched: Scheduler, parent: Request, child: Request) -> None:
    num_prompt = parent.num_prompt_tokens
    sched.kv_cache_manager.fork(parent, child, num_prompt)
    child.num_computed_tokens = num_prompt - 1
    if child.num_cached_tokens < 0:
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
    child.status = RequestStatus.RUNNING
    child.first_scheduled_time = time.monotonic()
    sched.running.append(child)
    sched._tables_to_reset.add(child.request_id)  # new to the runner: the whole table
    sched.num_forks_total += 1


def drop_fork_waiting(sched: Scheduler, child: Request) -> None:
    """Removes a child still waiting for its fork (an abort)."""
    for parent_id, children in list(sched.fork_waiting.items()):
        if child in children:
            children.remove(child)
            if not children:
                del sched.fork_waiting[parent_id]
            return


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples' params: n=1 and its own seed (seed + i, wrapped to int64), as the
    server's choices (server/openai/serving.py child_params)."""
    seed = params.seed
    if seed is not None and i:
        seed = (seed + i + 2**63) % 2**64 - 2**63
    return replace(params, n=1, seed=seed)
