"""Admission: what can never run is refused before it is queued (no torch).

check_fits is the one context-length and never-fits check (vLLM's wording, code
context_length_exceeded); the server and the offline API both reach it through
LLMEngine.make_request -> Scheduler.check_fits.
"""

from __future__ import annotations

from engine.core.pooling import check_pooling_fits
from engine.core.request import Request, RequestRejectedError


def check_fits(sched, request: Request) -> None:
    """Reject what could never run, instead of queueing it to livelock."""
    if request.pooling_params is not None:  # no token sampled (engine/core/pooling.py)
        return check_pooling_fits(sched, request)
    num_prompt = request.num_prompt_tokens
    max_tokens = request.sampling_params.max_tokens
    max_len = sched.max_model_len
    if max_tokens is None:
        if num_prompt >= max_len:  # not even one token would fit
            raise RequestRejectedError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"request has {num_prompt} input tokens. Please reduce the length of the "
                "input messages.",
                "prompt",
                "context_length_exceeded",
            )
    elif num_prompt + max_tokens > max_len:
        raise RequestRejectedError(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            "prompt",
            "context_length_exceeded",
        )
    needed = sched.kv_cache_manager.max_blocks_per_request(max_kv_tokens(max_len, request))
    if needed > sched.kv_cache_manager.num_blocks:
        raise RequestRejectedError(
            f"The request needs {needed} KV cache blocks but the whole pool has "
            f"{sched.kv_cache_manager.num_blocks}; it can never run. Reduce the prompt or "
            "max_tokens, or start the server with a larger KV cache."
        )


def max_kv_tokens(max_model_len: int, request: Request) -> int:
    """Most tokens that will ever hold KV: every token but the last one sampled."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:  # runs until max_model_len, always sampling at least one token
        return max(max_model_len, request.num_prompt_tokens + 1) - 1
    return request.num_prompt_tokens + max_tokens - 1
