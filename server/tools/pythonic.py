"""pythonic (Llama 3.2, ToolACE and others): calls as a Python list of keyword-argument calls.

    [get_weather(city="Paris", days=3), get_time(zone=1)]

Argument values are Python literals (strings, numbers, True/False/None, lists, dicts; JSON's
true/false/null too), sent as JSON. Output that does not open with such a list is content, all
of it. A call is sent whole (id, name and arguments) once its closing parenthesis arrives: its
arguments are re-written as JSON, so they cannot stream before the call is read. What follows the
list is content.
"""

from __future__ import annotations

import ast
import json
import re

from server.tools.base import Parsed, PrefixToolParser, bracket_end, skip_ws

_CALL_HEAD = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_PARTIAL_HEAD = re.compile(r"[A-Za-z_][\w.]*\s*\Z")


def call_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes text[start] ('('), skipping Python strings."""
    return bracket_end(text, start, quotes="'\"")


class _JsonNames(ast.NodeTransformer):
    """JSON's true / false / null read as Python's literals (templates that write values with
    `tojson` teach models to write them)."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802 - ast's visitor name
        if node.id in self.VALUES:
            return ast.copy_location(ast.Constant(self.VALUES[node.id]), node)
        return node


def read_call(source: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one `f(a=1, ...)`, None if it is not such a call."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            kwargs[kw.arg] = ast.literal_eval(_JsonNames().visit(kw.value))
        return ast.unparse(node.func), json.dumps(kwargs, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicToolParser(PrefixToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if start == len(text):
            return Parsed(text if final else "", [])
        if text[start] != "[":
            return Parsed(text, [])
        calls: list[tuple[str, str]] = []
        pos = last = start + 1

        def stop() -> Parsed:  # what follows the last call is content (all, before the first)
            if not calls:
                return Parsed(text, [])
            return Parsed(text[last:] if text[last:].strip() else "", calls)

        while True:
            q = skip_ws(text, pos)
            if q < len(text) and calls:
                if text[q] == "]":
                    return Parsed(text[q + 1 :] if text[q + 1 :].strip() else "", calls)
                if text[q] != ",":
                    return stop()
                q = skip_ws(text, q + 1)
            if q == len(text):
                return stop() if final else Parsed("", calls)
            m = _CALL_HEAD.match(text, q)
            if m is None:
                if not final and _PARTIAL_HEAD.match(text, q):  # the name is still arriving
                    return Parsed("", calls)
                return stop()
            end = call_end(text, m.end() - 1)
            if end is None:
                return stop() if final else Parsed("", calls)
            call = read_call(text[q:end])
            if call is None:
                return stop()
            calls.append(call)
            pos = last = end
