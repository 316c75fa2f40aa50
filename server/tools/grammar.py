"""The Lark grammars (llguidance) that constrain a chat's output to tool calls.

    format       one call                                                     several
    hermes       <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>        newline-separated
    generic      {"tool_call": {"name": N, "arguments": A}}                   {"tool_calls": [C, C]}
    llama3_json  {"name": N, "parameters": A}                                 "; "-separated
    mistral      [TOOL_CALLS][{"name": N, "arguments": A}]                    [TOOL_CALLS][C, C]

"required" calls are hermes ones (generic on a template with no tool support); "auto" with a
response_format is the template's own format (`union_grammar`; pythonic templates get hermes).

Each call's arguments follow that function's parameters schema, laid out as OpenAI's JSON is
(`", "`, `": "`, no free whitespace). Optional alternatives: `answer` (a response_format: a JSON
answer in its schema) and `text` (plain text that does not open with `{`, for the generic format's
"auto", where calls are JSON too).
"""

from __future__ import annotations

import json

from engine.sampling_params import GrammarSpec

# The JSON inside a forced call is laid out as OpenAI's is (see engine/sample/structured_output.py).
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# generic "auto": text is anything that does not open with '{' (or whitespace), so it is no call
_TEXT_RULE = r"text: /[^{\s][\s\S]*/"
# the opening brace is a lexeme of its own: an answer's JSON grammar opens with the same one
_ONE, _MANY = '"tool_call": ', '"tool_calls": ['


def with_layout(schema: dict) -> dict:
    return {**schema, "x-guidance": {**_X_GUIDANCE, **schema.get("x-guidance", {})}}


def _answer_rule(answer: GrammarSpec) -> str:
    schema = {"type": "object"} if answer.kind == "json_object" else json.loads(answer.text)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return f"answer: %json {json.dumps(with_layout(schema), ensure_ascii=False)}"


def _start(calls: str, answer: GrammarSpec | None, text: bool) -> list[str]:
    alternatives = ["calls"] + (["answer"] if answer else []) + (["text"] if text else [])
    rules = [f"start: {' | '.join(alternatives)}", f"calls: {calls}"]
    if answer:
        rules.append(_answer_rule(answer))
    if text:
        rules.append(_TEXT_RULE)
    return rules


def _functions(
    functions: list[dict], head: str, tail: str, key: str = "arguments", brace_apart: bool = False
) -> list[str]:
    """`call` = one of the functions: head + its name + arguments (under `key`) in its schema +
    tail. `brace_apart`: the call's opening brace is a lexeme of its own (the call may start
    the output, where an answer's JSON opens with the same brace)."""
    rules = ["call: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        name = f'"name": {json.dumps(fn["name"])}, {json.dumps(key)}: '
        opening = f'"{{" {json.dumps(name)}' if brace_apart else json.dumps(f"{head}{{{name}")
        rules.append(f"fn{i}: {opening} args{i} {json.dumps('}' + tail)}")
        rules.append(f"args{i}: %json {json.dumps(with_layout(fn['parameters']))}")
    return rules


def required_grammar(
    functions: list[dict], parallel: bool, answer: GrammarSpec | None = None
) -> GrammarSpec:
    """One hermes call to any of the functions (or several, newline-separated); with `answer`,
    either those calls or a JSON answer in its schema."""
    calls = f"call ({json.dumps(chr(10))} call)*" if parallel else "call"
    rules = _start(calls, answer, text=False)
    rules += _functions(functions, "<tool_call>\n", "\n</tool_call>")
    return GrammarSpec("grammar", "\n".join(rules))


def generic_grammar(
    functions: list[dict], parallel: bool, answer: GrammarSpec | None = None, text: bool = False
) -> GrammarSpec:
    """Calls in the generic format: `{"tool_call": C}`, or with `parallel` also
    `{"tool_calls": [C, ...]}`; or a JSON answer (`answer`), or plain text (`text`)."""
    lit = json.dumps  # a Lark string literal
    one = f"{lit('{')} {lit(_ONE)} call {lit('}')}"
    many = f"{lit('{')} {lit(_MANY)} call ({lit(', ')} call)* {lit(']}')}"
    rules = _start(f"{one} | {many}" if parallel else one, answer, text)
    return GrammarSpec("grammar", "\n".join(rules + _functions(functions, "", "")))


def union_grammar(
    call_format: str | None, functions: list[dict], parallel: bool, answer: GrammarSpec
) -> tuple[GrammarSpec, str]:
    """"auto" with a response_format: calls in the chat template's format, or the answer;
    (the grammar, the parser that reads it)."""
    lit = json.dumps
    if call_format == "generic":
        return generic_grammar(functions, parallel, answer), "generic"
    if call_format == "llama3_json":
        calls = f"call ({lit('; ')} call)*" if parallel else "call"
        rules = _start(calls, answer, False)
        rules += _functions(functions, "", "", "parameters", brace_apart=True)
        return GrammarSpec("grammar", "\n".join(rules)), "llama3_json"
    if call_format == "mistral":
        more = f" ({lit(', ')} call)*" if parallel else ""
        rules = _start(f"{lit('[TOOL_CALLS][')} call{more} {lit(']')}", answer, False)
        return GrammarSpec("grammar", "\n".join(rules + _functions(functions, "", ""))), "mistral"
    return required_grammar(functions, parallel, answer), "hermes"
