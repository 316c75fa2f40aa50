"""mistral: content, then `[TOOL_CALLS]` and either a JSON list of `{"name", "arguments"}` objects
(tokenizers before v11) or `name[ARGS]{...}` (v11 and later; `name{...}` also read), one
`[TOOL_CALLS]` per call. Ids are 9 letters and digits, as Mistral's templates require.

A call object in name-first order streams its arguments as they arrive (their raw text, no
partial-JSON parsing); other orders are read once the object closes. What follows the last call
and is no call is content; a first call that does not parse leaves the text content.
"""

from __future__ import annotations

import random
import re
import string

from server.tools.base import (
    JSON_CALL_HEAD,
    Parsed,
    PrefixToolParser,
    json_call_at,
    object_end,
    partial_tag_len,
    rest_of_calls,
    skip_ws,
)

_MISTRAL_HEAD = re.compile(JSON_CALL_HEAD + r'"arguments"\s*:\s*(?=\{)')


def new_mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralToolParser(PrefixToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _FN_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)")

    def new_id(self) -> str:
        return new_mistral_id()

    def parse(self, text: str, final: bool) -> Parsed:
        i = text.find(self.TAG)
        if i < 0:
            return Parsed(text[: len(text) - (0 if final else partial_tag_len(text, self.TAG))], [])
        j = skip_ws(text, i + len(self.TAG))
        if j == len(text):
            return Parsed(text if final else text[:i], [])
        read = self._list if text[j] == "[" else self._named
        parsed = read(text, i, j, final)
        return Parsed(text[:i] + parsed.content, parsed.calls)

    def _list(self, text: str, tag: int, pos: int, final: bool) -> Parsed:
        """`[{...}, {...}]` from text[pos]; content is what follows it (or all from `tag`)."""
        calls: list[tuple[str, str]] = []
        pos += 1
        last = tag
        while True:
            q = skip_ws(text, pos)
            if q < len(text) and calls:
                if text[q] == "]":
                    return Parsed(text[q + 1 :] if text[q + 1 :].strip() else "", calls)
                if text[q] != ",":
                    return Parsed(text[last:], calls)
                q = skip_ws(text, q + 1)
            if q == len(text):
                return rest_of_calls(text[tag:], calls, last - tag, final)
            item = text[q] == "{" and json_call_at(text, q, final, _MISTRAL_HEAD, ("arguments",))
            if item is False:
                return Parsed(text[last:], calls)
            if item is None:
                return Parsed("", calls)
            name, args, end = item
            calls.append((name, args))
            if end is None:
                return Parsed("", calls)
            pos = last = end

    def _named(self, text: str, tag: int, pos: int, final: bool) -> Parsed:
        """`name[ARGS]{...}` after each tag, from text[pos]; content is what follows the last."""
        calls: list[tuple[str, str]] = []
        last = tag
        pos = tag + len(self.TAG)
        while True:
            m = self._FN_NAME.match(text, pos)
            if m is None:
                undecided = not final and not text[pos:].strip()
                return Parsed("", calls) if undecided else Parsed(text[last:], calls)
            after = text[m.end() :]
            if after.startswith(self.ARGS):
                a = skip_ws(text, m.end() + len(self.ARGS))
            elif after.startswith("{"):
                a = m.end()
            elif not final and self.ARGS.startswith(after):  # the name or [ARGS] goes on
                return Parsed("", calls)
            else:
                return Parsed(text[last:], calls)
            if a == len(text) and not final:
                return Parsed("", calls)
            if a == len(text) or text[a] != "{":
                return Parsed(text[last:], calls)
            end = object_end(text, a)
            calls.append((m.group(1), text[a : end or len(text)]))
            if end is None:
                return Parsed("", calls)
            last = end
            q = skip_ws(text, end)
            if text.startswith(self.TAG, q):
                pos = q + len(self.TAG)
            elif not final and self.TAG.startswith(text[q:]):
                return Parsed("", calls)
            else:
                return Parsed(text[end:] if text[end:].strip() else "", calls)
