"""Tool calling on chat: tool_choice required / named / auto / none, history with tool calls,
streamed calls as OpenAI streams them, LangChain, and refusals."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess, build_byte_tokenizer, openai_schema_validator, wait_idle
from tests.tool_templates import TEMPLATES

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]
# tool_calls as OpenAI documents them (the schema excerpt leaves them out)
TOOL_CALL_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
}


# EOS (<|im_end|>, id 2) wherever the grammar allows it: a random-weight model would otherwise
# go on appending parallel calls until max_tokens.
EOS_BIAS = {"2": 50.0}


def chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 300)
    kw.setdefault("tools", TOOLS)
    if kw.get("tool_choice") not in (None, "auto", "none"):
        kw.setdefault("logit_bias", EOS_BIAS)
    return client.chat.completions.create(model="tiny", **kw)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_required_always_returns_valid_calls(tclient, tools_server):
    validator = openai_schema_validator("CreateChatCompletionResponse")
    for seed in range(2):
        body = httpx.post(
            tools_server.url + "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": MESSAGES,
                "tools": TOOLS,
                "max_tokens": 300,
                "tool_choice": "required",
                "seed": seed,
                "temperature": 1.0,
                "logit_bias": EOS_BIAS,
            },
            timeout=60,
        ).json()
        calls = body["choices"][0]["message"].pop("tool_calls")
        jsonschema.validate(calls, TOOL_CALL_SCHEMA)
        validator.validate(body)
        r = chat(tclient, tool_choice="required", seed=seed, temperature=1.0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)


def test_named_function_returns_its_call_with_stop(tclient):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        c = chat(tclient, tool_choice=named, seed=seed, temperature=1.0).choices[0]
        assert c.finish_reason == "stop" and c.message.content is None
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
        check_calls(c.message.tool_calls)


def collect_stream(stream):
    """Rebuilds tool calls from chunks, checking OpenAI's order: id and name first."""
    calls, reasons = {}, []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_required_equals_whole(tclient, parallel):
    kw = dict(tool_choice="required", seed=7, temperature=1.0, parallel_tool_calls=parallel)
    whole = chat(tclient, **kw).choices[0].message.tool_calls
    streamed, reasons = collect_stream(chat(tclient, stream=True, **kw))
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (t.function.name, t.function.arguments) for t in whole
    ]
    if not parallel:
        assert len(whole) == 1
    for c in streamed:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_streamed_named_function(tclient):
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, reasons = collect_stream(
        chat(tclient, tool_choice=named, stream=True, seed=2, temperature=1.0)
    )
    assert reasons == ["stop"] and [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


AUTO_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,5}", "unit": "c"\}\}\n</tool_call>'
)


def test_auto_parses_the_hermes_format(tclient):
    """A regex makes the random model write a hermes call; auto mode must find it."""
    extra = {"structured_outputs": {"regex": r"Sure\. " + AUTO_CALL}}
    c = chat(tclient, tool_choice="auto", extra_body=extra, seed=1, temperature=1.0).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    check_calls(c.message.tool_calls)
    calls, reasons = collect_stream(
        chat(tclient, extra_body=extra, seed=1, temperature=1.0, stream=True)
    )
    assert reasons == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls
    ]


# Each parser's format, forced by a regex, and the content it leaves (None: no content).
OTHER_FORMATS = {
    "llama3_json": (
        r'<\|python_tag\|>\{"name": "get_weather", "parameters": '
        r'\{"city": "[a-z]{1,5}", "unit": "c"\}\}',
        None,
    ),
    "mistral": (
        r'Sure\. \[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "[a-z]{1,5}", "unit": "c"\}',
        "Sure. ",
    ),
    "pythonic": (r"\[get_weather\(city='[a-z]{1,5}', unit='c'\)\]", None),
}


@pytest.fixture(scope="module", params=sorted(OTHER_FORMATS))
def parser_server(request, tools_model_dir, tmp_path_factory):
    """The tiny model with a chat template in the parser's style, served with no tool flags."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    shutil.copytree(tools_model_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(TEMPLATES[request.param][0])
    server = ServerProcess(
        str(path), "--dtype", "float32", "--served-model-name", "tiny"
    ).wait_ready()
    yield request.param, server
    server.stop()


def test_auto_with_each_other_parser(parser_server):
    """No tool flags, a llama3_json|mistral|pythonic chat template: the parser read from it
    (and logged) finds the call a regex makes the random model write, whole and streamed."""
    name, server = parser_server
    assert f"tool calling: auto, parser {name} (the chat template writes" in server.log()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    regex, content = OTHER_FORMATS[name]
    kw = dict(extra_body={"structured_outputs": {"regex": regex}}, seed=1, temperature=1.0)
    c = chat(client, tool_choice="auto", **kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == content
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")
    calls, reasons = collect_stream(chat(client, stream=True, **kw))
    assert reasons == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls] == [
        ("get_weather", call.function.arguments)
    ]
    wait_idle(server.url)


def test_auto_with_response_format_in_each_templates_format(parser_server):
    """"auto" + response_format on a llama3_json|mistral|pythonic template: one grammar of calls
    in the template's format (hermes for pythonic) or the answer; either way a valid reply."""
    name, server = parser_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    answer = {"type": "object", "properties": {"zeta": {"type": "integer", "maximum": 9}},
              "required": ["zeta"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": answer}}
    kinds = set()
    for seed in range(4):
        c = chat(client, tool_choice="auto", response_format=fmt, logit_bias=EOS_BIAS,
                 max_tokens=120, seed=seed, temperature=1.0).choices[0]  # fmt: skip
        if c.message.tool_calls:
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
                # the parser that read it: Mistral's 9-character ids, "call_..." otherwise
                assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")
            assert c.finish_reason == "tool_calls" and c.message.content is None
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(c.message.content), answer)
            kinds.add("answer")
    assert kinds
    wait_idle(server.url)


def test_auto_and_none_without_a_call_are_plain_text(tclient):
    for choice in ("auto", "none"):
        c = chat(tclient, tool_choice=choice, max_tokens=10, temperature=0.0).choices[0]
        assert c.message.tool_calls is None and c.finish_reason == "length"


def test_history_with_tool_calls_is_rendered_by_the_template(tclient, tools_model_dir):
    from transformers import AutoTokenizer

    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]
    r = chat(tclient, messages=history, max_tokens=2)
    tok = AutoTokenizer.from_pretrained(tools_model_dir)
    rendered = tok.apply_chat_template(
        [
            *history[:1],
            {
                **history[1],
                "tool_calls": [
                    {
                        **history[1]["tool_calls"][0],
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Oslo", "unit": "c"},
                        },
                    }
                ],
            },
            history[2],
        ],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "sunny, 21" in rendered and '"city": "Oslo"' in rendered and "get_time" in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
                ]
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tool_choice": "required", "structured_outputs": {"json": {"type": "object"}}},
            "structured_outputs",
        ),
    ],
)
def test_refusals_before_any_byte(tools_server, kw, param):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "stream": True, **kw}
    with httpx.stream(
        "POST", tools_server.url + "/v1/chat/completions", json=body, timeout=30
    ) as r:
        assert r.status_code == 400, r.read()
        assert json.loads(r.read())["error"]["param"] == param
    wait_idle(tools_server.url)


def test_langchain_structured_output_and_tools(tools_server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        population: int = Field(ge=0, le=999)

    llm = ChatOpenAI(
        base_url=tools_server.url + "/v1",
        api_key="x",
        model="tiny",
        max_tokens=200,
        temperature=1.0,
        seed=4,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("a city")
        assert isinstance(city, City), method

    @tool
    def get_time(zone: int) -> str:
        """The time in a UTC zone."""
        return f"12:00 in {zone}"

    # LangChain's schema allows extra keys; favour "}" and EOS so the random model stops.
    closing = {str(build_byte_tokenizer().convert_tokens_to_ids("}")): 30.0, **EOS_BIAS}
    bound = llm.bind_tools([get_time], tool_choice="get_time").bind(logit_bias=closing)
    ai = bound.invoke("time?")
    assert [c["name"] for c in ai.tool_calls] == ["get_time"]
    assert isinstance(ai.tool_calls[0]["args"]["zone"], int)
    call = ai.tool_calls[0]
    history = [
        HumanMessage("time?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage(get_time.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    reply = llm.bind_tools([get_time]).invoke(history, max_tokens=5)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] in (
        "length",
        "stop",
        "tool_calls",
    )
    wait_idle(tools_server.url)


def test_server_keeps_serving(tclient, tools_server):
    with pytest.raises(openai.BadRequestError):
        chat(tclient, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert chat(tclient, tools=None, max_tokens=3).choices[0].finish_reason == "length"
    wait_idle(tools_server.url)
