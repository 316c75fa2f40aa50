"""llama3_json and mistral: tool calls written as JSON objects, whole or streamed.

llama3_json (Llama 3.1/3.2/3.3 with vLLM's JSON tool template): the whole output is calls, an
optional `<|python_tag|>` then objects `{"name": ..., "parameters": {...}}` ("arguments" also
read) separated by `;`. Output that does not open with a call is content, all of it.

mistral: content, then `[TOOL_CALLS]` and either a JSON list of `{"name", "arguments"}` objects
(tokenizers before v11) or `name[ARGS]{...}` (v11 and later; `name{...}` also read), one
`[TOOL_CALLS]` per call. Ids are 9 letters and digits, as Mistral's templates require.

Either way a call object in name-first order streams its arguments as they arrive (their raw
text, no partial-JSON parsing); other orders are read once the object closes. What follows the
last call and is no call is content; a first call that does not parse leaves the text content.
"""

from __future__ import annotations

import json
import random
import re
import string

from server.tool_call_text import Parsed, PrefixToolParser, object_end, partial_tag_len, skip_ws

_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
_LLAMA_HEAD = re.compile(_NAME + r'"(?:parameters|arguments)"\s*:\s*(?=\{)')
_MISTRAL_HEAD = re.compile(_NAME + r'"arguments"\s*:\s*(?=\{)')
_LLAMA_KEYS = ("parameters", "arguments")


def json_call_at(
    text: str, start: int, final: bool, head: re.Pattern, keys: tuple[str, ...]
) -> tuple[str, str, int | None] | bool | None:
    """The call object opening at text[start] ('{'): (name, arguments so far, index past the
    object or None while it is open); False when it is no call; None while undecided."""
    m = head.match(text, start)
    if m is not None:
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            return False
        args_end = object_end(text, m.end())
        if args_end is None:
            return name, text[m.end() :], None
        return name, text[m.end() : args_end], object_end(text, start)
    end = object_end(text, start)
    if end is None:
        return False if final else None
    try:
        obj = json.loads(text[start:end])
    except json.JSONDecodeError:
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return False
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, dict):
        return False
    return obj["name"], json.dumps(args, ensure_ascii=False), end


def _rest(text: str, calls: list, start: int, final: bool) -> Parsed:
    """The text ran out after the calls read so far (from `start`): whitespace is no content."""
    if not calls:
        return Parsed(text if final else "", [])
    return Parsed(text[start:] if final and text[start:].strip() else "", calls)


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
                return _rest(text, calls, last, final)
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
                return _rest(text[tag:], calls, last - tag, final)
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
