"""llama3_json (Llama 3.1/3.2/3.3 with vLLM's JSON tool template): the whole output is calls, an
optional `<|python_tag|>` then objects `{"name": ..., "parameters": {...}}` ("arguments" also
read) separated by `;`. Output that does not open with a call is content, all of it.

A call object in name-first order streams its arguments as they arrive (their raw text, no
partial-JSON parsing); other orders are read once the object closes. What follows the last call
and is no call is content.
"""

from __future__ import annotations

import re

from server.tools.base import (
    JSON_CALL_HEAD,
    Parsed,
    PrefixToolParser,
    json_call_at,
    rest_of_calls,
    skip_ws,
)

_LLAMA_HEAD = re.compile(JSON_CALL_HEAD + r'"(?:parameters|arguments)"\s*:\s*(?=\{)')
_LLAMA_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(PrefixToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        lead = text[start:]
        if lead.startswith(self.TAG):
            start += len(self.TAG)
        elif not final and self.TAG.startswith(lead):  # may still become the tag
            return Parsed("", [])
        calls: list[tuple[str, str]] = []
        pos = last = start
        while True:
            j = skip_ws(text, pos)
            if calls and j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            if j == len(text):
                return rest_of_calls(text, calls, last, final)
            item = text[j] == "{" and json_call_at(text, j, final, _LLAMA_HEAD, _LLAMA_KEYS)
            if item is False:
                return Parsed(text[last:] if calls else text, calls)
            if item is None:
                return Parsed("", calls)
            name, args, end = item
            calls.append((name, args))
            if end is None:
                return Parsed("", calls)
            pos = last = end
