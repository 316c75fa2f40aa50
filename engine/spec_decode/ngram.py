"""N-gram (prompt lookup) speculative decoding: its config and the proposer (no torch).

A decoding request whose last tokens already occurred earlier in its prompt + output gets the
tokens that followed that occurrence as drafts. The scheduler runs the request's newest token
and its K drafts as one chunk of 1 + K query tokens; the rejection sampler verifies the drafts
against the target model's logits at each position (engine/sample/rejection_sampler.py,
RejectionSampler.verify, which the runner calls). Drafting is here, verification there.

    | ...... computed ...... | newest | d1 .. dK |   scheduled: 1 + K query tokens
                               row 0    rows 1..K  -> accept d1..da, plus one bonus token

Requests that follow a grammar get no drafts (their matcher advances one sampled token at a
time and cannot be rolled back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

SPEC_METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys for the n-gram method."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """From JSON text or a dict; ValueError naming the key that is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r} (supported: {list(_KEYS)})"
            )
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {method!r}"
            )
        k = value.get("num_speculative_tokens")
        n_max = value.get("prompt_lookup_max", None)
        n_min = value.get("prompt_lookup_min", None)
        # vLLM: either bound alone sets both
        n_max = n_min if n_max is None else n_max
        n_min = n_max if n_min is None else n_min
        n_max, n_min = (5, 5) if n_max is None else (n_max, n_min)  # vLLM's defaults
        for key, v in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_max", n_max),
            ("prompt_lookup_min", n_min),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {v!r}")
        if n_min > n_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({n_min}) must not exceed "
                f"prompt_lookup_max ({n_max})"
            )
        return cls(method, k, n_max, n_min)


class NgramProposer:
    """Longest suffix n-gram (max_n down to min_n) seen earlier -> the k tokens that followed.

    Among earlier occurrences of the suffix the latest one with k tokens after it wins (the
    text being repeated is usually the nearest), else the earliest (the longest continuation).
    Cost: one vectorized comparison over the request's tokens per n tried.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            # windows starting at i cover [i, i + n); a match needs a token after it, before
            # the suffix itself: i + n <= num_tokens - 1
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts) == 0:
                continue
            full = starts[starts + n + k <= num_tokens]
            start = int(full[-1] if len(full) else starts[0]) + n
            return tokens[start : start + k].tolist()
        return []


@dataclass
class SpecDecodeStats:
    """One step's drafts: how many requests had drafts, their tokens, how many were accepted
    (in total and by draft position, vLLM's num_accepted_tokens_per_pos)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] | None = None

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodeStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
