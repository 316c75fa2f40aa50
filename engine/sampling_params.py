"""Per-request sampling parameters (OpenAI names, temperature 0 means greedy)."""

from __future__ import annotations

import math
from dataclasses import dataclass

_INT64_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be between 1 and 128, got {self.n}")
        if math.isnan(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed <= _INT64_MAX:
            raise ValueError("seed must fit in a signed 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
