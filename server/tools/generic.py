"""generic: tool calls for chat templates with no tool support (llama.cpp's generic format).

The whole output is one JSON object holding the calls, or it is plain text:

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    {"tool_calls": [{"name": "get_weather", "arguments": {...}}, {"name": ..., "arguments": ...}]}
    It is sunny in Oslo.

The server tells the model so in the system prompt (server/tools/generic_prompt.py) and a
grammar holds it to it (server/tools/grammar.py). Output that does not open with one of the two
heads is content, all of it; a call in name-first order streams its arguments as they arrive.
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

_CALL_HEAD = re.compile(JSON_CALL_HEAD + r'"arguments"\s*:\s*(?=\{)')
_OUTER = re.compile(r'\{\s*"(tool_calls?)"\s*:\s*')
_HEADS = ('{"tool_call":{', '{"tool_calls":[')


def _opening(text: str, start: int, final: bool) -> tuple[bool, int] | bool | None:
    """(several calls?, index of the first call) for the head at text[start]; False: no head;
    None: it may still become one."""
    m = _OUTER.match(text, start)
    if m is not None:
        several = m.group(1) == "tool_calls"
        j = skip_ws(text, m.end())
        if j == len(text):
            return False if final else None
        if text[j] != ("[" if several else "{"):
            return False
        return several, skip_ws(text, j + 1) if several else j
    squeezed = "".join(text[start:].split())
    if not final and any(h.startswith(squeezed) for h in _HEADS):
        return None
    return False


class GenericToolParser(PrefixToolParser):
    name = "generic"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if start == len(text):
            return Parsed(text if final else "", [])
        if text[start] != "{":
            return Parsed(text, [])
        head = _opening(text, start, final)
        if head is None:
            return Parsed("", [])
        if head is False:
            return Parsed(text, [])
        several, pos = head
        return self._calls(text, pos, several, final)

    def _calls(self, text: str, pos: int, several: bool, final: bool) -> Parsed:
        calls: list[tuple[str, str]] = []
        while True:
            if pos == len(text):
                return Parsed(text if final and not calls else "", calls)
            item = text[pos] == "{" and json_call_at(text, pos, final, _CALL_HEAD, ("arguments",))
            if item is False:  # no call where one belongs: the rest is content
                return Parsed(text[pos:] if calls else text, calls)
            if item is None:
                return Parsed("", calls)
            calls.append(item[:2])
            if item[2] is None:
                return Parsed("", calls)
            pos = skip_ws(text, item[2])
            if several and pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
                continue
            return self._close(text, pos, several, calls, final)

    @staticmethod
    def _close(text: str, pos: int, several: bool, calls: list, final: bool) -> Parsed:
        """After the last call: `]}` (several) or `}`, then nothing but whitespace."""
        for closer in "]}" if several else "}":
            pos = skip_ws(text, pos)
            if pos == len(text):
                return rest_of_calls(text, calls, pos, final)
            if text[pos] != closer:
                return Parsed(text[pos:], calls)
            pos += 1
        return rest_of_calls(text, calls, pos, final)
