"""The hermes tool-call parser: whole texts, and the same texts streamed in every split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_parsers import HermesToolParser, get_tool_parser

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


def stream(text: str, cuts: list[int]):
    """Feeds the pieces between the cut points; returns content and calls as a client rebuilds
    them, checking OpenAI's order: a call's first delta has id and name, later ones neither."""
    streamer = HermesToolParser().streamer()
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


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
