"""What every tool-call parser shares: the call and delta types, and one way to stream.

A parser that can read any prefix of a text (`parse(text, final)`) streams by reading the text so
far after each piece and sending what grew: content, new calls (id and name first), and the new
tail of each call's arguments. `parse` promises that on a longer text every earlier answer stays a
prefix of the new one (content, the list of calls, each call's arguments), and that with
`final=False` it names a call only once its name is complete; then the streamed calls are the
whole text's calls in every split of the text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ExtractedToolCalls:
    content: str
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries id and name, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class Parsed:
    """A text prefix read so far: its content and calls, each (name, arguments text so far)."""

    content: str
    calls: list[tuple[str, str]]


_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def bracket_end(text: str, start: int, quotes: str = '"') -> int | None:
    """Index just past the bracket that closes the one at text[start], skipping strings opened by
    any of `quotes` (backslash escapes); at a mismatched closer, just past it (a parse of that
    span then fails); None if not closed yet."""
    expected: list[str] = []
    quote, escaped = "", False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSERS:
            expected.append(_CLOSERS[ch])
        elif ch in ")]}":
            if expected.pop() != ch or not expected:
                return i + 1
    return None


def object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object that opens at text[start] ('{'), None if not closed yet."""
    return bracket_end(text, start)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class PrefixToolParser:
    """A parser defined by `parse(text, final)` (see the module docstring)."""

    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_id(self) -> str:
        return new_tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole text, and the content around them."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(name, args, self.new_id()) for name, args in parsed.calls]
        return ExtractedToolCalls(parsed.content, calls)

    def streamer(self) -> PrefixStreamer:
        return PrefixStreamer(self.parse, self.new_id)


class PrefixStreamer:
    """Feeds text deltas; each feed returns what the text so far adds to what was sent."""

    def __init__(self, parse: Callable[[str, bool], Parsed], new_id: Callable[[], str]) -> None:
        self.parse, self.new_id = parse, new_id
        self.text = ""
        self.num_content = 0  # characters of content already sent
        self.num_args: list[int] = []  # per call, characters of its arguments already sent

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return self._send(self.parse(self.text, False))

    def finish(self, cut: bool = False) -> StreamDelta:
        """The end of the text; `cut` (the token limit): what is still undecided is dropped."""
        return self._send(self.parse(self.text, not cut))

    def _send(self, parsed: Parsed) -> StreamDelta:
        assert len(parsed.content) >= self.num_content and len(parsed.calls) >= len(self.num_args)
        out = StreamDelta(parsed.content[self.num_content :])
        self.num_content = len(parsed.content)
        for i, (name, args) in enumerate(parsed.calls):
            if i == len(self.num_args):
                out.tool_calls.append(ToolCallDelta(i, self.new_id(), name))
                self.num_args.append(0)
            if len(args) > self.num_args[i]:
                out.tool_calls.append(ToolCallDelta(i, arguments=args[self.num_args[i] :]))
                self.num_args[i] = len(args)
        return out


JSON_CALL_HEAD = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'


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


def rest_of_calls(text: str, calls: list, start: int, final: bool) -> Parsed:
    """The text ran out after the calls read so far (from `start`): whitespace is no content."""
    if not calls:
        return Parsed(text if final else "", [])
    return Parsed(text[start:] if final and text[start:].strip() else "", calls)
