"""Engine logprobs (TokenLogprobs) -> the completions (legacy) and chat JSON shapes."""

from __future__ import annotations

import math
import re

from engine.outputs import TokenLogprobs
from server.openai.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_MIN_LOGPROB = -9999.0  # OpenAI's stand-in for "very unlikely"; JSON has no -Infinity


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable character table used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {ch: b for b, ch in _bytes_to_unicode().items()}


def safe_logprob(value: float) -> float:
    return _MIN_LOGPROB if math.isnan(value) or value < _MIN_LOGPROB else value


class TokenStrings:
    """Per-token display text and exact UTF-8 bytes, cached by id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = s
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._raw_bytes(token_id)
            self._bytes[token_id] = b
        return b

    def _raw_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._special:
            m = _BYTE_FALLBACK.match(piece)
            if m:  # sentencepiece byte-fallback token
                return [int(m.group(1), 16)]
            if self.byte_level and all(ch in _UNICODE_TO_BYTE for ch in piece):
                return [_UNICODE_TO_BYTE[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))


def _top_with_sampled(lp: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """The k best alternatives plus the sampled token (vLLM: up to k + 1 entries)."""
    top = list(lp.top[:k])
    if all(t != lp.token_id for t, _ in top):
        top.append((lp.token_id, lp.logprob))
    return top


class CompletionLogprobsBuilder:
    """Accumulates the legacy shape; text_offset continues across stream chunks."""

    def __init__(self, strings: TokenStrings, num_top: int, text_offset: int = 0) -> None:
        self.strings, self.num_top = strings, num_top
        self.next_offset = text_offset

    def build(
        self, token_ids: list[int], logprobs: list[TokenLogprobs | None] | None
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        entries = logprobs if logprobs is not None else [None] * len(token_ids)
        for token_id, lp in zip(token_ids, entries):
            token = self.strings.text(token_id)
            out.tokens.append(token)
            out.text_offset.append(self.next_offset)
            self.next_offset += len(token)
            if lp is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(safe_logprob(lp.logprob))
            top = {}
            for t, v in _top_with_sampled(lp, self.num_top):
                top.setdefault(self.strings.text(t), safe_logprob(v))
            out.top_logprobs.append(top)
        return out


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def chat_logprobs(
    strings: TokenStrings, logprobs: list[TokenLogprobs], num_top: int
) -> list[ChatTokenLogprob]:
    """The chat shape: one entry per token with exactly the top `num_top` alternatives."""
    return [
        ChatTokenLogprob(
            token=strings.text(lp.token_id),
            logprob=safe_logprob(lp.logprob),
            bytes=strings.bytes(lp.token_id),
            top_logprobs=[
                TopLogprob(token=strings.text(t), logprob=safe_logprob(v), bytes=strings.bytes(t))
                for t, v in lp.top[:num_top]
            ],
        )
        for lp in logprobs
    ]
