"""tools / tool_choice checks and the grammars that force a call."""

from __future__ import annotations

import pytest

from engine.sampling_params import GrammarSpec, SamplingParamsError
from server.tools.hermes import HermesToolParser
from server.tools.plan import plan_tools, template_messages
from server.tools.registry import get_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


def accepts(tokenizer, compiler, spec, text: str) -> bool:
    m = compiler.compile(spec).new_matcher()
    return m.consume_tokens(tokenizer.encode(text)) and m.is_accepting()


def test_modes():
    assert plan_tools(None, None, None, False).mode == "none"
    assert plan_tools([WEATHER], "none", None, False).mode == "none"
    assert plan_tools([WEATHER], None, None, True).mode == "auto"
    assert plan_tools([WEATHER], "required", None, False).mode == "required"
    named = plan_tools([WEATHER, NOOP], {"type": "function", "function": {"name": "noop"}}, None, 0)
    assert (named.mode, named.function_name) == ("named", "noop")


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ([WEATHER], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        ([WEATHER], "auto", "tool_choice"),  # the server was not started with auto tool choice
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "nope"}}], None, "tools"),
        ([{"type": "code_interpreter"}], "required", "tools"),
        ([WEATHER, WEATHER], "required", "tools"),
    ],
)
def test_refusals_name_the_field(tools, choice, param):
    with pytest.raises(SamplingParamsError) as e:
        plan_tools(tools, choice, None, False)
    assert e.value.param == param


def test_required_grammar_forces_hermes_calls(tokenizer, compiler):
    spec = plan_tools([WEATHER, NOOP], "required", None, False).grammar
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(tokenizer, compiler, spec, one) and accepts(tokenizer, compiler, spec, two)
    assert HermesToolParser().extract(two).tool_calls[1].name == "noop"
    for bad in [
        "",  # at least one call
        one.replace("get_weather", "get_weathe"),
        one.replace('"Oslo"', "5"),
        one.replace('{"city"', '{ "city"'),  # no free whitespace inside the JSON
    ]:
        assert not accepts(tokenizer, compiler, spec, bad), bad


def test_one_call_without_parallel_tool_calls(tokenizer, compiler):
    spec = plan_tools([NOOP], "required", False, False).grammar
    one = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(tokenizer, compiler, spec, one)
    assert not accepts(tokenizer, compiler, spec, one + "\n" + one)


def test_named_function_grammar_is_its_parameters(tokenizer, compiler):
    spec = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, 1, 0)
    assert accepts(tokenizer, compiler, spec.grammar, '{"city": "Rome"}')
    assert not accepts(tokenizer, compiler, spec.grammar, '{"town": "Rome"}')


def test_history_arguments_become_objects():
    history = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = template_messages(history)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert out[1] == history[1]
    # arguments that are no JSON (a call cut by the token limit, sent back) stay text
    cut_call = {"function": {"arguments": "{"}}
    cut = template_messages([{"role": "assistant", "tool_calls": [cut_call]}])
    assert cut[0]["tool_calls"][0]["function"]["arguments"] == "{"
    with pytest.raises(SamplingParamsError):
        template_messages([{"role": "assistant", "tool_calls": [{"function": "f"}]}])


GENERIC_ONE = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
GENERIC_TWO = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "noop", "arguments": {}}]}'
)
CITY = {"type": "object", "properties": {"zeta": {"type": "integer"}}, "required": ["zeta"]}


def test_generic_grammars_for_templates_without_tools(tokenizer, compiler):
    """auto: calls or plain text (not opening with '{'); required: calls; named: one call to
    it; auto with a response_format: calls or the answer's JSON; parallel off: one call."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    def plan(choice, parallel=None, answer=None):
        return plan_tools([WEATHER, NOOP], choice, parallel, True, answer, "generic")

    cases = {
        "auto": (plan("auto"), [GENERIC_ONE, GENERIC_TWO, "It is sunny {x}"]),
        "required": (plan("required"), [GENERIC_ONE, GENERIC_TWO]),
        "one": (plan("required", False), [GENERIC_ONE]),
        "named": (plan(named), [GENERIC_ONE]),
        "answer": (
            plan("auto", None, GrammarSpec.json_schema(CITY)),
            [GENERIC_ONE, GENERIC_TWO, '{"zeta": 3}'],
        ),
    }
    everything = [GENERIC_ONE, GENERIC_TWO, "It is sunny {x}", '{"zeta": 3}', "", " lead", "{}"]
    everything.append(GENERIC_ONE.replace("Oslo", 'Oslo", "u": "1'))  # not in the schema
    everything.append(GENERIC_ONE.replace("get_weather", "get_weathe"))  # not declared
    for case, (p, good) in cases.items():
        assert p.generic and p.parser == "generic" and p.parses_calls, case
        for text in everything:
            assert accepts(tokenizer, compiler, p.grammar, text) == (text in good), (case, text)
    assert plan("none").grammar is None and plan("none").generic


UNION_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    "generic": GENERIC_ONE,
}


@pytest.mark.parametrize("call_format", [*UNION_CALLS, "pythonic"])
def test_auto_with_response_format_uses_the_templates_call_format(
    tokenizer, compiler, call_format
):
    """One grammar: calls in the template's own format or the answer; the plan's parser reads
    the calls back and leaves the answer as content. Pythonic templates get hermes calls."""
    answer = GrammarSpec.json_schema(CITY)
    p = plan_tools([WEATHER, NOOP], "auto", None, True, answer, call_format)
    expected = call_format if call_format in UNION_CALLS else "hermes"
    assert p.parser == expected
    call = UNION_CALLS[expected]
    for text, ok in [(call, True), ('{"zeta": 3}', True), ("plain", False)]:
        assert accepts(tokenizer, compiler, p.grammar, text) == ok, text
    others = [t for f, t in UNION_CALLS.items() if f != expected]
    assert not any(accepts(tokenizer, compiler, p.grammar, t) for t in others)
    parser = get_tool_parser(expected)
    assert [(c.name, c.arguments) for c in parser.extract(call).tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert parser.extract('{"zeta": 3}').content == '{"zeta": 3}'
