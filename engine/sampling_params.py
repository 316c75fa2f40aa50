"""Per-request sampling parameters (OpenAI names plus vLLM's extras; temperature 0 is greedy), and
the grammar a request's output follows (GrammarSpec; engine/sample/structured_output.py compiles
it)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are held back until this many tokens exist
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None  # the same for each prompt token (echo + logprobs)
    skip_special_tokens: bool = True
    structured_outputs: GrammarSpec | None = None  # the grammar the output must follow
    # beam search (vLLM's request fields, transformers' meanings; engine/core/beam_search.py):
    # n is the beam width and the number of sequences returned
    use_beam_search: bool = False
    length_penalty: float = 1.0  # score = sum of logprobs / generated length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        """Each field in its range; the first one out of range raises (in this order)."""
        self._validate_sampling()
        self._validate_lengths()
        self._validate_outputs()
        self._validate_beam_search()

    def _validate_sampling(self) -> None:
        """n and the knobs that shape the distribution: temperature, top-p/k, min-p, penalties."""
        _check(1 <= self.n <= 128, "n", f"n must be between 1 and 128, got {self.n}")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check(
            not math.isnan(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"top_p must be in (0, 1], got {self.top_p}",
        )
        _check(self.top_k >= 0, "top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check(
            not math.isnan(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )

    def _validate_lengths(self) -> None:
        """max_tokens, min_tokens and the seed."""
        if self.max_tokens is not None:
            _check(
                self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            )
        _check(self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be <= max_tokens"
            )
        if self.seed is not None:
            _check(
                _INT64_MIN <= self.seed <= _INT64_MAX,
                "seed",
                "seed must fit in a signed 64-bit integer",
            )

    def _validate_outputs(self) -> None:
        """What shapes the output: stop strings, logprobs counts, logit_bias values."""
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed",
        )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    0 <= value <= MAX_LOGPROBS, name, f"{name} must be between 0 and {MAX_LOGPROBS}"
                )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias for {token_id} must be in [-100, 100]",
            )

    def _validate_beam_search(self) -> None:
        """early_stopping's three values, a finite length_penalty; what beam search refuses."""
        _check(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            f'early_stopping must be true, false or "never", got {self.early_stopping!r}',
        )
        _check(
            math.isfinite(self.length_penalty),
            "length_penalty",
            f"length_penalty must be a finite number, got {self.length_penalty}",
        )
        if not self.use_beam_search:
            return
        for name in ("logprobs", "prompt_logprobs", "structured_outputs"):
            _check(
                getattr(self, name) is None,
                name,
                f"{name} is not supported with use_beam_search; leave it unset",
            )
        _check(self.min_tokens == 0, "min_tokens", "min_tokens is not supported with beam search")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class SamplingParamsError(ValueError):
    """A ValueError that names the offending request field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    ok = not math.isnan(value) and lo <= value <= hi
    _check(ok, name, f"{name} must be in [{lo:g}, {hi:g}], got {value}")


GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


def _canonical(node, properties: bool = False):
    """A schema with sorted keys (equal schemas share a cache entry), except the names in a
    `properties` map: their order is the order the output's keys take (OpenAI keeps it)."""
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    if properties:
        return {k: _canonical(v) for k, v in node.items()}
    return {k: _canonical(node[k], k == "properties") for k in sorted(node)}


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request's output: the cache key of its compiled grammar.

    json: a JSON schema (keys sorted but for property names, so equal schemas share an entry);
    json_object: any JSON object; regex; choice: a JSON list of strings; grammar: Lark or GBNF.
    """

    kind: GrammarKind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        return cls("json", json.dumps(_canonical(schema), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


class GrammarError(ValueError):
    """A grammar that cannot be used (invalid, unsupported or too slow to compile): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
