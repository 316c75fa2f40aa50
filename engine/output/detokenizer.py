"""Incremental detokenization that never emits half a character or prompt text."""

from __future__ import annotations

_PROMPT_CONTEXT = 6  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    """Decodes a short window of tokens per step and emits only the text past what was emitted.

        | prompt context | emitted ...... | prefix_offset: read_offset | new |
                                          `---- decoded as prefix ----'
        delta = decode(window + new)[len(decode(window)):]

    Text is held back while the decode ends in U+FFFD (an unfinished UTF-8 sequence from
    byte-level or byte-fallback tokens); flush() releases it at finish. The prompt context is
    only ever part of the prefix, so none of it reaches the output.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At finish: whatever is still held back (an unfinished character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta
