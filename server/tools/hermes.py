"""Tool calls out of generated text (vLLM's `--tool-call-parser` names), whole or streamed.

hermes (Qwen2.5/Qwen3, Hermes): calls are JSON objects between tags, text around them is content:

    Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>

A call is read in one of two ways, the same whole or streamed:
- the body starts `{"name": "<name>", "arguments": {` (the order models and our grammars emit):
  the call is the name and the raw text of the arguments object, so a stream sends id and
  name as soon as the name is complete and then the arguments as they arrive (a string-aware
  brace counter finds their end; no partial-JSON parsing, so nothing is re-serialised);
- otherwise the body must be a JSON object with a string `name` (and object `arguments`), read
  once its closing tag (or the end of the text) arrives.
Anything else between the tags stays content, tags included.
"""

from __future__ import annotations

import json
import re

from server.tools.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)
from server.tools.base import object_end as _object_end
from server.tools.base import partial_tag_len as _partial_tag_len

START, END = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def _parse_head(body: str) -> tuple[str, int] | None:
    """(name, index where the arguments object opens) for a body in name-first order."""
    m = _HEAD.match(body)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    return name, m.end()


def _parse_body(body: str) -> tuple[str, str] | None:
    """(name, arguments text) of a call body, None if it is not a call.

    Name-first bodies are calls whatever follows the name (a stream has sent it by then); their
    arguments run to the end of the object, or of the body if the object never closes.
    """
    head = _parse_head(body)
    if head is not None:
        name, start = head
        return name, body[start : _object_end(body, start) or len(body)]
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolParser:
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole text, and the content around them."""
        content, calls, pos = [], [], 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            end = text.find(END, start)
            stop = len(text) if end < 0 else end + len(END)
            parsed = _parse_body(text[start + len(START) : end if end >= 0 else len(text)])
            if parsed is None:
                content.append(text[start:stop])
            else:
                calls.append(ToolCall(*parsed))
            pos = stop
            if end < 0:
                break
        return ExtractedToolCalls("".join(content), calls)

    def streamer(self) -> HermesToolStreamer:
        return HermesToolStreamer()


class HermesToolStreamer:
    """The same reading as `extract`, fed text deltas; each feed returns what can be sent now."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet sent: a possible tag start, or the current call's body
        self.in_call = False
        self.num_calls = 0
        self.head: tuple[str, int] | None = None  # the current call's name and arguments start
        self.num_args_sent = 0  # characters of the current arguments object already sent
        self.args_done = False

    def feed(self, text: str) -> StreamDelta:
        self.buffer += text
        out = StreamDelta()
        while self._advance(out):
            pass
        return out

    def finish(self, cut: bool = False) -> StreamDelta:
        """At the end of the text: an unclosed call is read as if its tag closed here. `cut`
        (the token limit): a call whose name is incomplete, or a partial tag, is dropped."""
        out = StreamDelta()
        if self.in_call and not (cut and self.head is None):
            self._stream_arguments(out, final=True)
            self._close_call(out, self.buffer, "")
        elif not cut:
            out.content += self.buffer
        self.in_call = False
        self.buffer = ""
        return out

    def _advance(self, out: StreamDelta) -> bool:
        """One state change, True when another may follow."""
        if not self.in_call:
            start = self.buffer.find(START)
            if start < 0:
                keep = _partial_tag_len(self.buffer, START)
                out.content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            out.content += self.buffer[:start]
            self.buffer = self.buffer[start + len(START) :]
            self.in_call, self.head, self.num_args_sent, self.args_done = True, None, 0, False
            return True
        self._stream_arguments(out)
        end = self.buffer.find(END)
        if end < 0:
            return False
        body, self.buffer = self.buffer[:end], self.buffer[end + len(END) :]
        self._close_call(out, body, END)
        return True

    def _stream_arguments(self, out: StreamDelta, final: bool = False) -> None:
        """Sends the name once it is complete, then the arguments object as far as it goes."""
        end = self.buffer.find(END)
        body = self.buffer if end < 0 else self.buffer[:end]
        if self.head is None:
            self.head = _parse_head(body)
            if self.head is None:
                return
            out.tool_calls.append(ToolCallDelta(self.num_calls, new_tool_call_id(), self.head[0]))
        if self.args_done:
            return
        start = self.head[1]
        stop = _object_end(body, start)
        if stop is not None:
            self.args_done = True
        elif end >= 0 or final:
            stop = len(body)
        else:  # hold back what may be the start of the closing tag
            stop = len(body) - _partial_tag_len(body, END)
        piece = body[start + self.num_args_sent : stop]
        if piece:
            self.num_args_sent += len(piece)
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=piece))

    def _close_call(self, out: StreamDelta, body: str, tag: str) -> None:
        if self.head is not None:  # already streamed: the arguments object is the call
            self.num_calls += 1
        else:
            parsed = _parse_body(body)
            if parsed is None:
                out.content += START + body + tag
            else:
                d = ToolCallDelta(self.num_calls, new_tool_call_id(), parsed[0], parsed[1])
                out.tool_calls.append(d)
                self.num_calls += 1
        self.in_call, self.head = False, None
