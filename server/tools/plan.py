"""Chat tools: validating `tools` and `tool_choice`, and the grammar that enforces a choice.

    tool_choice   what constrains the output              how calls are read      finish_reason
    "none"        nothing (tools still reach the template) no calls               as generated
    "auto"        nothing                                  the template's parser   "tool_calls"
    "auto" with   grammar: calls in the template's        the grammar's format    "tool_calls"
     response_format  format (grammar.py) | the schema
    "required"    grammar: one or more hermes calls        hermes                  "tool_calls"
    named         grammar: that function's parameters      the text is arguments   "stop"

With a chat template that has no tool support (call format "generic", server/tools/generic.py)
the tools go into the system prompt and every mode but "none" has a grammar in that format:
"auto" is calls or plain text (or calls or the response_format's schema), "required" calls, a
named function one call to it (read as a call, finish_reason "stop").

A forced call is written in the hermes format (`<tool_call>\\n{"name": ..., "arguments": ...}
\\n</tool_call>`), name first, so its arguments stream as they are generated. With a
response_format, "required" / named force the call (the schema is for the final answer, after the
tool results) and "auto" lets the model call or answer in the schema. `parallel_tool_calls:
false` allows one call. Whitespace that only separates calls is no content; a call cut by the
token limit leaves no markup in the content.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Literal

from engine.sampling_params import GrammarSpec, SamplingParamsError
from server.tools.base import StreamDelta, ToolCallDelta, new_tool_call_id
from server.tools.grammar import generic_grammar, required_grammar, union_grammar
from server.tools.registry import get_tool_parser

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    mode: ToolMode
    functions: list[dict]  # each {"name", "description"?, "parameters"}
    grammar: GrammarSpec | None = None
    function_name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # the format a grammar forces; None: the server's
    generic: bool = False  # the chat template has no tool support: the generic format

    @property
    def parses_calls(self) -> bool:
        """The text holds calls in a format (a named call in the generic format, too)."""
        return self.mode in ("auto", "required") or (self.mode == "named" and self.generic)


def check_tools(tools: list | None) -> list[dict]:
    """The function definitions of `tools`; 400 naming `tools` for anything malformed."""
    functions = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise SamplingParamsError("tools", f"tools[{i}]: only tools of type function")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise SamplingParamsError("tools", f"tools[{i}].function.name must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise SamplingParamsError("tools", f"tools[{i}].function.parameters must be an object")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise SamplingParamsError("tools", "tools must have distinct function names")
    return functions


def plan_tools(
    tools: list | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
    answer: GrammarSpec | None = None,
    call_format: str | None = None,
) -> ToolPlan:
    """`answer`: the response_format grammar, if any (json or json_object); `call_format`:
    "generic" for a chat template with no tool support (every mode but "none" gets a grammar)."""
    generic = call_format == "generic"
    functions = check_tools(tools)
    if not functions:
        if tool_choice not in (None, "none"):
            raise SamplingParamsError("tool_choice", "tool_choice needs tools")
        return ToolPlan("none", [], generic=generic)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", functions, generic=generic)
    parallel = parallel_tool_calls is not False
    if choice == "auto" and not auto_enabled:
        msg = '"auto" tool choice is off on this server (--disable-auto-tool-choice)'
        raise SamplingParamsError("tool_choice", msg)
    name = None if choice in ("auto", "required") else _named_function(choice)
    if name is not None and all(f["name"] != name for f in functions):
        raise SamplingParamsError("tool_choice", f"tool_choice names {name!r}, not in tools")
    if generic:
        return _generic_plan(functions, name or choice, parallel, answer)
    if choice == "auto":
        if answer is None:
            return ToolPlan("auto", functions, parallel=parallel)
        grammar, parser = union_grammar(call_format, functions, parallel, answer)
        return ToolPlan("auto", functions, grammar, parallel=parallel, parser=parser)
    if choice == "required":
        grammar = required_grammar(functions, parallel)
        return ToolPlan("required", functions, grammar, parallel=parallel, parser="hermes")
    fn = next(f for f in functions if f["name"] == name)
    return ToolPlan("named", functions, GrammarSpec.json_schema(fn["parameters"]), name)


def _generic_plan(
    functions: list[dict], choice: str, parallel: bool, answer: GrammarSpec | None
) -> ToolPlan:
    """The generic format's plan: "auto" is calls or text (or the answer's schema), "required"
    calls, a named function one call to it (`choice` is its name)."""
    if choice in ("auto", "required"):
        answer = answer if choice == "auto" else None
        text = choice == "auto" and answer is None
        grammar = generic_grammar(functions, parallel, answer, text)
        return ToolPlan(choice, functions, grammar, None, parallel, "generic", generic=True)
    named = [f for f in functions if f["name"] == choice]
    grammar = generic_grammar(named, False)
    return ToolPlan("named", functions, grammar, choice, False, "generic", generic=True)


def _named_function(choice) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if isinstance(name, str):
            return name
    msg = 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}'
    raise SamplingParamsError("tool_choice", msg)


def template_messages(messages: list[dict]) -> list[dict]:
    """History for the chat template: assistant tool-call arguments as objects, as templates
    (Qwen's, Hermes') expect; OpenAI sends them as JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise SamplingParamsError("messages", "tool_calls must be a list of objects")
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise SamplingParamsError("messages", "a tool call's function must be an object")
    fn = dict(fn)
    args = fn.get("arguments")
    if isinstance(args, str):
        # a call cut by the token limit comes back as it was sent: its text stays text
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


class ToolCallReader:
    """One choice's generated text -> content and tool-call deltas, by its plan's mode."""

    def __init__(self, plan: ToolPlan, parser_name: str | None) -> None:
        self.plan = plan
        self.streamer = None
        if plan.parses_calls:  # a grammar's calls are in its format whatever the server's
            self.streamer = get_tool_parser(plan.parser or parser_name or "hermes").streamer()
        self.call_id: str | None = None
        self.num_calls = 0
        self.held = ""  # leading whitespace held back: no content if only calls follow
        self.has_text = False  # content other than whitespace was sent

    def feed(self, text: str) -> StreamDelta:
        if self.streamer is not None:
            return self._tidy(self.streamer.feed(text), final=False)
        if self.plan.mode != "named":
            return StreamDelta(content=text)
        out = StreamDelta()
        if self.call_id is None:
            self.call_id = new_tool_call_id()
            out.tool_calls.append(ToolCallDelta(0, self.call_id, self.plan.function_name))
            self.num_calls = 1
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self, cut: bool = False) -> StreamDelta:
        """The end of the text; `cut`: it ended at the token limit (an open call's markup is
        dropped, not sent as content)."""
        if self.streamer is not None:
            return self._tidy(self.streamer.finish(cut), final=True)
        return self.feed("") if self.plan.mode == "named" else StreamDelta()

    def _tidy(self, delta: StreamDelta, final: bool) -> StreamDelta:
        """Counts the calls, drops calls past the first without parallel_tool_calls, and holds
        whitespace until text follows (dropped at the end when there are calls and no text)."""
        calls = [d for d in delta.tool_calls if self.plan.parallel or d.index == 0]
        self.num_calls += sum(1 for d in calls if d.name is not None)
        content = self.held + delta.content
        self.held = ""
        if not self.has_text and not content.strip() and not (final and not self.num_calls):
            self.held, content = ("" if final else content), ""
        self.has_text = self.has_text or bool(content.strip())
        return StreamDelta(content, calls)

    def finish_reason(self, generated: str | None) -> str | None:
        """OpenAI's: "tool_calls" when auto or required produced calls; a named call "stop"."""
        if generated == "stop" and self.num_calls and self.plan.mode != "named":
            return "tool_calls"
        return generated
