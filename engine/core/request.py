"""A generation request as the scheduler and KV cache manager see it (no torch here)."""

from __future__ import annotations

import enum
import hashlib
import time

from engine.sampling_params import SamplingParams


class RequestRejectedError(ValueError):
    """A request that can never run (HTTP 400): `param` names the field, `code` as OpenAI's."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: object) -> str | None:
    """vLLM's rule for a request's cache_salt: None, or a non-empty string of at most 128
    characters without '@', '/', '\\' or NUL. RequestRejectedError (param cache_salt) else."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        got = "an empty string" if salt == "" else type(salt).__name__
        msg = f"cache_salt must be a non-empty string if provided (got {got})"
        raise RequestRejectedError(msg, "cache_salt")
    if len(salt) > MAX_CACHE_SALT_LENGTH or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        msg = (f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters and must not "
               "contain '@', '/', '\\' or NUL")
        raise RequestRejectedError(msg, "cache_salt")
    return salt


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token ids so far plus how many of them have KV in the cache.

    | prompt tokens ............ | output tokens ... |
    | computed (KV cached)  | new (scheduled) | owed |
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # every id the model declares as EOS (Llama 3 has several), besides eos_token_id
        self.eos_token_ids = eos_token_ids or frozenset()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # llguidance.LLMatcher when the output follows a grammar: it has consumed exactly the
        # output tokens so far (the sampler masks and advances it), whatever the KV holds.
        self.grammar = None
        # Prefix-cache identity beyond the token ids (vLLM's "extra keys"): the user's
        # cache_salt (vLLM's request field) and the LoRA adapter's content identity go into the
        # first block's hash and so, chained, into every block's (salt_key); mm_spans is (start,
        # length, content hash) per image, hashed into every block that holds one of the image's
        # placeholder tokens.
        self.cache_salt: str | None = None
        self.mm_spans: list[tuple[int, int, bytes]] = []
        # engine.multimodal.inputs.ImageInput per image (its span and pixels), for the runner
        self.mm_inputs: list = []
        # n > 1: the sibling (same prompt) this request is forked from once that one has
        # computed the prompt (engine/core/forks.py); None: an ordinary request.
        self.fork_parent_id: str | None = None
        # seats under max_num_seqs held beyond its own: a beam group's first beam holds the
        # width - 1 its forks will take (engine/core/beam_search.py), 0 once they are forked
        self.extra_seats = 0
        # the LoRA adapter this request runs under (engine/lora LoRARequest), None: the base
        self.lora_request = None
        # engine.core.pooling.PoolingParams: pooled when its prompt is computed, never sampled
        self.pooling_params = None

    @property
    def salt_key(self) -> bytes:
        """The first block's own key: the adapter's content identity, then the user's salt as
        a fixed-length digest (so no salt can spell another's salt plus an image hash)."""
        key = self.lora_request.cache_salt if self.lora_request is not None else b""
        if self.cache_salt:
            key += b"salt:" + hashlib.sha256(self.cache_salt.encode("utf-8")).digest()
        return key

    def block_extra_keys(self, start: int, end: int) -> bytes:
        """Extra hash keys of the block holding token positions [start, end)."""
        salt = self.salt_key if start == 0 else b""
        keys = [salt] if salt else []
        keys += [h for s, n, h in self.mm_spans if s < end and s + n > start]
        return b"".join(keys)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return self.pooling_params is not None and self.pooling_params.skip_reading_prefix_cache

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)
