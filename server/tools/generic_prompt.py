"""What a chat template with no tool support is given, so its model can call tools and read
the results (the generic format, server/tools/generic.py):

- the tools and how to call them go into the system prompt, after the request's own system
  message (one is added when there is none);
- an earlier assistant turn's calls become its text, the JSON the model would have written;
- tool results become one user turn per run of `tool` messages, a line each:
  `{"tool_response": {"name": "get_weather", "content": "sunny"}}`.
"""

from __future__ import annotations

import json

_SYSTEM_ROLES = ("system", "developer")


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_instructions(
    functions: list[dict], mode: str, function_name: str | None, parallel: bool
) -> str:
    """The system prompt's part on tools (see docs/serving.md, "Templates with no tool
    support")."""
    lines = ["You can call tools. Each tool's name, description and arguments (a JSON Schema):"]
    lines += [
        _dumps({k: fn[k] for k in ("name", "description", "parameters") if k in fn})
        for fn in functions
    ]
    lines.append("To call a tool, reply with only this JSON object and nothing else:")
    lines.append('{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}')
    if parallel:
        lines.append('To call several tools at once: {"tool_calls": [<call>, <call>, ...]}')
    lines.append('Tool results come back as {"tool_response": {"name": ..., "content": ...}}.')
    if mode == "named":
        lines.append(f"Call the tool {function_name} now.")
    elif mode == "required":
        lines.append("Call a tool now.")
    else:
        lines.append("When no tool is needed, answer in plain text.")
    return "\n".join(lines)


def calls_text(tool_calls: list[dict]) -> str:
    """An assistant turn's calls as the generic format writes them."""
    calls = []
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):  # text that is no JSON object stays a string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": fn.get("name"), "arguments": {} if args is None else args})
    if len(calls) == 1:
        return _dumps({"tool_call": calls[0]})
    return _dumps({"tool_calls": calls})


def _history(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            names |= {c.get("id"): (c.get("function") or {}).get("name") for c in m["tool_calls"]}
            text = "\n".join(t for t in (m.get("content") or "", calls_text(m["tool_calls"])) if t)
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": text})
        elif m.get("role") == "tool":
            name = names.get(m.get("tool_call_id")) or m.get("name")
            line = _dumps({"tool_response": {"name": name, "content": m.get("content") or ""}})
            if out and out[-1].get("from_tools"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "from_tools": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "from_tools"} for m in out]


def generic_conversation(
    messages: list[dict],
    functions: list[dict],
    mode: str,
    function_name: str | None = None,
    parallel: bool = True,
) -> list[dict]:
    """The messages a template with no tool support renders (see the module docstring)."""
    out = _history(messages)
    if not functions or mode == "none":
        return out
    text = tools_instructions(functions, mode, function_name, parallel)
    if out and out[0].get("role") in _SYSTEM_ROLES:
        first = out[0].get("content") or ""
        return [{**out[0], "content": f"{first}\n\n{text}" if first else text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]
