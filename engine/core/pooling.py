"""Pooling requests on the shared scheduler (no torch): vLLM V1's PoolingParams.

A pooling request (a causal embedder's prompt) is an ordinary Request with `pooling_params`
set: it is admitted, chunked under the token budget, preempted and prefix-cached like any
prefill, and it finishes in the step whose chunk computes its last prompt token, with the
runner's pooled vector (engine/runner/pooling_hook.py) and no sampled token, never decoding.
Mean, CLS and max pooling need every prompt position's hidden state, so such requests skip the
prefix-cache lookup (their blocks are still cached for others); last-token pooling may hit,
as the last token is always computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.request import Request, RequestRejectedError, RequestStatus


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = "LAST"  # CLS | MEAN | LAST | MAX (engine/runner/pooling_config.py)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Only the last token's hidden state survives a prefix hit."""
        return self.pooling_type != "LAST"


def check_pooling_fits(scheduler, request: Request) -> None:
    """A pooling request's context check: its prompt alone holds KV, no token is sampled."""
    num_prompt, max_len = request.num_prompt_tokens, scheduler.max_model_len
    if num_prompt > max_len:
        raise RequestRejectedError(
            f"This model's maximum context length is {max_len} tokens. However, your request "
            f"has {num_prompt} input tokens. Please reduce the length of the input.",
            "input",
            "context_length_exceeded",
        )
    kv = scheduler.kv_cache_manager
    needed = kv.max_blocks_per_request(num_prompt)
    if needed > kv.num_blocks:
        raise RequestRejectedError(
            f"The input needs {needed} KV cache blocks but the whole pool has {kv.num_blocks}; "
            "it can never run. Shorten the input or start the server with a larger KV cache.",
            "input",
        )


def finish_pooled(scheduler, pooled_ids, results: list) -> int:
    """Finishes the requests the runner pooled this step (their blocks are freed now, cached
    ones stay for prefix hits); each joins `results` with no new token. Returns how many."""
    now = time.monotonic()
    num = 0
    for rid in pooled_ids:
        req = scheduler.requests.get(rid)
        if req is None or req.status is not RequestStatus.RUNNING:
            continue
        req.status = RequestStatus.FINISHED_STOPPED
        req.first_token_time = now  # the embedding is the request's first (and only) output
        scheduler._free_finished(req)  # noqa: SLF001 - the scheduler's own finishing path
        results.append((req, []))
        num += 1
    return num
