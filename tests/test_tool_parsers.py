"""The tool-call parsers (hermes, llama3_json, mistral, pythonic): whole texts, and the same
texts streamed in every split."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools.hermes import HermesToolParser
from server.tools.registry import TOOL_PARSERS, get_tool_parser

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>"
)
TEXTS = [
    "no calls here, just text with a < and a </tool_call> lookalike",
    CALL,
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL.replace("Paris", 'Ni{c}e \\"q\\" }'),
    '<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "swap"}</tool_call> after',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
    '"arguments": {"s": "<tool_call>"}}</tool_call>',
    "before <tool_call>not json at all</tool_call> after",
    '<tool_call>\n{"name": "unclosed", "arguments": {"k": "v"}}',  # the text ended in the call
    '<tool_call>{"name": "uni", "arguments": {"t": "caf\\u00e9 ☕"}}</tool_call>',
    '<tool_call>{"name": "cut", "arguments": {"a": 1</tool_call>tail',  # never closed: kept as is
]
EXPECTED = [
    (TEXTS[0], []),
    ("", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("Let me check.\n", [("get_weather", '{"city": "Paris", "days": 3}')]),
    (
        "\n",
        [
            ("get_weather", '{"city": "Paris", "days": 3}'),
            ("get_weather", '{"city": "Ni{c}e \\"q\\" }", "days": 3}'),
        ],
    ),
    (" after", [("swap", '{"x": [1, {"y": "}"}]}')]),
    ("", [("f", "{}"), ("g", '{"s": "<tool_call>"}')]),
    (TEXTS[6], []),
    ("", [("unclosed", '{"k": "v"}')]),
    ("", [("uni", '{"t": "caf\\u00e9 ☕"}')]),
    ("tail", [("cut", '{"a": 1')]),
]


def calls_of(extracted) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in extracted.tool_calls]


@pytest.mark.parametrize("text,expected", zip(TEXTS, EXPECTED))
def test_whole_text(text, expected):
    out = HermesToolParser().extract(text)
    assert (out.content, calls_of(out)) == expected
    for name, arguments in calls_of(out):
        assert name == "cut" or isinstance(json.loads(arguments), dict)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


def stream(text: str, cuts: list[int], parser: str = "hermes"):
    """Feeds the pieces between the cut points; returns content and calls as a client rebuilds
    them, checking OpenAI's order: a call's first delta has id and name, later ones neither."""
    streamer = get_tool_parser(parser).streamer()
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [streamer.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [streamer.finish()]
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.id and tc.name, "the first delta of a call names it"
                calls[tc.index] = [tc.name, tc.arguments]
            else:
                assert tc.id is None and tc.name is None
                calls[tc.index][1] += tc.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_split_streams_the_same_calls(data):
    for text, expected in zip(TEXTS, EXPECTED):
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
        assert stream(text, cuts) == expected


def test_character_by_character():
    for text, expected in zip(TEXTS, EXPECTED):
        assert stream(text, list(range(len(text)))) == expected


def test_arguments_stream_before_the_call_closes():
    streamer = HermesToolParser().streamer()
    first = streamer.feed('<tool_call>{"name": "f", "arguments": {"a": "lo')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("f", ""), (None, '{"a": "lo')]
    assert streamer.feed('ng"}}').tool_calls[0].arguments == 'ng"}'


W = '{"city": "Paris", "days": 3}'
# parser -> [(text, (content, calls))]
CASES = {
    "generic": [
        ("It is sunny. {not a call}", ("It is sunny. {not a call}", [])),
        (
            f'{{"tool_call": {{"name": "get_weather", "arguments": {W}}}}}',
            ("", [("get_weather", W)]),
        ),
        (
            '{ "tool_calls" : [ {"name": "f", "arguments": {"s": "a]}"}} ,{"name": "g", '
            '"arguments": {}} ] }\n',
            ("", [("f", '{"s": "a]}"}'), ("g", "{}")]),
        ),
        (
            '{"tool_call": {"arguments": {"x": [1, {"y": "}"}]}, "name": "swap"}}',
            ("", [("swap", '{"x": [1, {"y": "}"}]}')]),
        ),
        ('{"tool_call": {"name": "f", "arguments": {}}} and then', (" and then", [("f", "{}")])),
        ('{"tool_calls": [{"name": "f", "arguments": {}}; x]}', ("; x]}", [("f", "{}")])),
        ('{"response": "hi"}', ('{"response": "hi"}', [])),
        ('{"tool_calls": {"a": 1}}', ('{"tool_calls": {"a": 1}}', [])),
        ('{"tool_call": {"name": "cut", "arguments": {"a": 1', ("", [("cut", '{"a": 1')])),
        (" \n ", (" \n ", [])),
        (
            '{"tool_call": {"name": "uni", "arguments": {"t": "caf\u00e9 ☕"}}}',
            ("", [("uni", '{"t": "caf\u00e9 ☕"}')]),
        ),
    ],
    "llama3_json": [
        ("plain answer; no {call}", ("plain answer; no {call}", [])),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', ("", [("get_weather", W)])),
        (
            '{"name": "f", "parameters": {"s": "a;}"}}; {"name": "g", "arguments": {}}',
            ("", [("f", '{"s": "a;}"}'), ("g", "{}")]),
        ),
        (
            '  {"parameters": {"x": [1, {"y": "}"}]}, "name": "swap"}',
            ("", [("swap", '{"x": [1, {"y": "}"}]}')]),
        ),
        ('{"name": "f", "parameters": {}} and then text', (" and then text", [("f", "{}")])),
        ('{"not": "a call"} trailing', ('{"not": "a call"} trailing', [])),
        ('<|python_tag|>{"name": "cut", "parameters": {"a": 1', ("", [("cut", '{"a": 1')])),
        ("<|python_tag|> just words", ("<|python_tag|> just words", [])),
        (
            '{"name": "uni", "parameters": {"t": "caf\\u00e9 ☕"}}\n',
            ("", [("uni", '{"t": "caf\\u00e9 ☕"}')]),
        ),
    ],
    "mistral": [
        ("no calls [TOOL_CALL lookalike", ("no calls [TOOL_CALL lookalike", [])),
        (
            f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, '
            '{"name": "g", "arguments": {"s": "]"}}]',
            ("Sure. ", [("get_weather", W), ("g", '{"s": "]"}')]),
        ),
        (
            '[TOOL_CALLS] [{"arguments": {"a": [1]}, "name": "swap"}]',
            ("", [("swap", '{"a": [1]}')]),
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Ni{c}e \\"q\\" }"}'
            '[TOOL_CALLS]get_time[ARGS]{"zone": 1}',
            ("", [("get_weather", '{"city": "Ni{c}e \\"q\\" }"}'), ("get_time", '{"zone": 1}')]),
        ),
        ('[TOOL_CALLS]f{"a": 1} done', (" done", [("f", '{"a": 1}')])),
        ("x [TOOL_CALLS]not json", ("x [TOOL_CALLS]not json", [])),
        ('[TOOL_CALLS][{"name": "cut", "arguments": {"a": 1', ("", [("cut", '{"a": 1')])),
        ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, oops]', (", oops]", [("f", "{}")])),
    ],
    "pythonic": [
        ("Plain text [not a list]", ("Plain text [not a list]", [])),
        ('[get_weather(city="Paris", days=3)]', ("", [("get_weather", W)])),
        (
            "[f(s='a)b', t=[1, (2)]), g.h(x={'k': None, 'b': True})]\n",
            ("", [("f", '{"s": "a)b", "t": [1, 2]}'), ("g.h", '{"x": {"k": null, "b": true}}')]),
        ),
        ("[f()] then text", (" then text", [("f", "{}")])),
        ("[f(1, 2)]", ("[f(1, 2)]", [])),
        ("[f(a=1), g(b=x)]", (", g(b=x)]", [("f", '{"a": 1}')])),
        ('[f(a="unclosed"', ('[f(a="unclosed"', [])),
        ('[f(t="caf\\u00e9 ☕")]', ("", [("f", '{"t": "café ☕"}')])),
        ("  []", ("  []", [])),
    ],
}
PARSER_CASES = [(name, text, expected) for name, cases in CASES.items() for text, expected in cases]


def test_every_parser_is_registered():
    assert sorted(TOOL_PARSERS) == ["generic", "hermes", "llama3_json", "mistral", "pythonic"]


@pytest.mark.parametrize("parser,text,expected", PARSER_CASES)
def test_whole_text_other_parsers(parser, text, expected):
    out = get_tool_parser(parser).extract(text)
    assert (out.content, calls_of(out)) == expected
    for name, arguments in calls_of(out):
        assert name == "cut" or isinstance(json.loads(arguments), dict)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)
    if parser == "mistral":  # Mistral's templates take 9 letters and digits
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in out.tool_calls)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_other_parsers_stream_the_same_calls_in_every_split(data):
    for parser, text, expected in PARSER_CASES:
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
        assert stream(text, cuts, parser) == expected, (parser, text, cuts)


@pytest.mark.parametrize("parser,text,expected", PARSER_CASES)
def test_other_parsers_character_by_character(parser, text, expected):
    assert stream(text, list(range(len(text))), parser) == expected


def test_json_arguments_stream_before_the_call_closes():
    for parser, text in [
        ("llama3_json", '{"name": "f", "parameters": {"a": "lo'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": "lo'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "lo'),
    ]:
        streamer = get_tool_parser(parser).streamer()
        first = streamer.feed(text)
        assert [(d.name, d.arguments) for d in first.tool_calls] == [("f", ""), (None, '{"a": "lo')]
        assert streamer.feed('ng"}}').tool_calls[0].arguments == 'ng"}'


def test_content_is_held_only_while_it_may_start_a_call():
    mistral = get_tool_parser("mistral").streamer()
    assert mistral.feed("Sure [TOOL_").content == "Sure "
    assert mistral.feed("CALLS]").content == ""
    llama = get_tool_parser("llama3_json").streamer()
    assert llama.feed("<|python").content == ""
    assert llama.feed("ic").content == "<|pythonic"
    pythonic = get_tool_parser("pythonic").streamer()
    assert pythonic.feed("  [get_wea").content == ""
    calls = pythonic.feed("ther(city='x')").tool_calls
    assert [(d.name, d.arguments) for d in calls] == [("get_weather", ""), (None, '{"city": "x"}')]


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
