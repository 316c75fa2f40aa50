"""The tool-call parser read from the chat template, and the calls each template writes read
back by it; the reader's output shapes (content null, cut calls, one call without parallel)."""

from __future__ import annotations

import json

import pytest

from server.tools.detect import choose_tool_parser, detect_tool_parser
from server.tools.generic_prompt import generic_conversation
from server.tools.plan import ToolCallReader, ToolPlan
from server.tools.registry import get_tool_parser
from tests.conftest import build_byte_tokenizer
from tests.tool_templates import TEMPLATES

CALLS = [
    ("get_weather", {"city": "Oslo", "unit": "c"}),
    ("get_time", {"zone": -3, "exact": True, "tags": ["a b", "c"]}),
]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {}}} for n, _ in CALLS]


def assistant_text(template: str, calls: list[tuple[str, dict]]) -> str:
    """What the template renders for an assistant turn holding `calls` (its generated text)."""
    tok = build_byte_tokenizer()
    tok.chat_template = template
    tool_calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
    ]
    if detect_tool_parser(template)[0] == "generic":  # the server writes the calls as text
        messages = generic_conversation(messages, [t["function"] for t in TOOLS], "auto")
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    return text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("style", list(TEMPLATES))
@pytest.mark.parametrize("num_calls", [1, 2])
def test_detected_parser_round_trips_the_templates_calls(style, num_calls):
    template, expected = TEMPLATES[style]
    name, why = detect_tool_parser(template)
    assert name == expected, why
    calls = CALLS[:num_calls]
    text = assistant_text(template, calls)
    parser = get_tool_parser(name)
    whole = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert not whole.content.strip()
    # streamed in 3-character pieces through the reader: the same calls, no content at all
    reader = ToolCallReader(ToolPlan("auto", []), name)
    pieces = [reader.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [reader.finish()]
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for p in pieces:
        assert p.content == ""
        for d in p.tool_calls:
            names.setdefault(d.index, d.name)
            args[d.index] = args.get(d.index, "") + d.arguments
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == calls


def test_template_without_tools_gets_generic_and_choice_is_logged():
    template, expected = TEMPLATES["none"]
    assert detect_tool_parser(template) == (expected, "the chat template has no tool support")
    assert expected == "generic" and detect_tool_parser(None)[0] == "generic"
    choice = choose_tool_parser(template, None, False)
    assert "parser generic (the chat template has no tool support)" in choice.log_line()
    off = choose_tool_parser(template, None, True)  # forced calls keep the generic format
    assert (off.parser, off.call_format) == (None, "generic")
    assert choose_tool_parser(template, "hermes", False).call_format == "hermes"
    choice = choose_tool_parser(TEMPLATES["mistral"][0], None, False)
    assert choice.parser == "mistral" and "mistral" in choice.log_line()
    assert choose_tool_parser(TEMPLATES["mistral"][0], "pythonic", False).parser == "pythonic"
    off = choose_tool_parser(TEMPLATES["hermes"][0], "hermes", True)
    assert off.parser is None and "off" in off.log_line()


def read_all(reader: ToolCallReader, text: str, cut: bool = False):
    deltas = [reader.feed(ch) for ch in text] + [reader.finish(cut)]
    content = "".join(d.content for d in deltas)
    calls = [d for x in deltas for d in x.tool_calls]
    return content, calls


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_whitespace_between_calls_is_no_content():
    content, calls = read_all(ToolCallReader(ToolPlan("required", []), None), f"\n{CALL}\n{CALL}\n")
    assert content == "" and len([d for d in calls if d.name]) == 2
    # text before a call stays, trailing space included; whitespace alone without calls stays
    content, _ = read_all(ToolCallReader(ToolPlan("auto", []), "hermes"), f"Sure. {CALL}")
    assert content == "Sure. "
    content, calls = read_all(ToolCallReader(ToolPlan("auto", []), "hermes"), " \n ")
    assert content == " \n " and not calls


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", 'ok <tool_call>\n{"name":'),
        ("hermes", "ok <tool_c"),
        ("llama3_json", '<|python_tag|>{"name": "get_wea'),
        ("mistral", "ok [TOOL_CALLS]get_wea"),
        ("pythonic", "[get_weather(city='Os"),
        ("generic", '{"tool_call": {"name": "get_wea'),
    ],
)
def test_a_call_cut_by_the_token_limit_leaves_no_markup(parser, text):
    content, calls = read_all(ToolCallReader(ToolPlan("auto", []), parser), text, cut=True)
    assert content in ("ok ", "") and not [d for d in calls if d.name]
    # not cut (a stop): what is no call is content, as before
    content, _ = read_all(ToolCallReader(ToolPlan("auto", []), parser), text)
    assert content.strip() and content != "ok "


def test_without_parallel_tool_calls_one_call():
    plan = ToolPlan("auto", [], parallel=False)
    _, calls = read_all(ToolCallReader(plan, "hermes"), f"{CALL}\n{CALL}")
    assert [d.index for d in calls if d.name] == [0]
