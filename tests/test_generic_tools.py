"""Tool calling on a chat template with no tool support (the generic format): a real server with
no tool flags, the official openai client. The tools reach the model in the system prompt, the
output is held to calls of the declared tools (or plain text for "auto"), and tool history is
rendered as text the model can read. The real-model version is marked `slow`."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess, build_byte_tokenizer, wait_idle
from tests.test_openai_tools import (
    EOS_BIAS,
    PARAMS,
    TOOLS,
    WEATHER_PARAMS,
    check_calls,
    collect_stream,
)
from tests.test_openai_tools import chat as _chat
from tests.tool_templates import NO_TOOLS

BRACE = str(build_byte_tokenizer().encode("{")[0])  # the token every generic call opens with
NAMED = {"type": "function", "function": {"name": "get_time"}}
TOOLS_WITH_TEXT = [
    {**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "Weather now, by city."}},
    TOOLS[1],
]


def chat(client, **kw):
    """The byte tokenizer spells the tool prompt byte by byte (~800 tokens of the 1024)."""
    return _chat(client, **{"max_tokens": 120, **kw})


@pytest.fixture(scope="module")
def generic_server(tools_model_dir, tmp_path_factory):
    """The tiny model with a chat template that ignores `tools`, served with no tool flags."""
    path = tmp_path_factory.mktemp("tiny-no-tools")
    shutil.copytree(tools_model_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(NO_TOOLS)
    server = ServerProcess(str(path), "--dtype", "float32", "--served-model-name", "tiny")
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def gclient(generic_server):
    return openai.OpenAI(base_url=generic_server.url + "/v1", api_key="x", max_retries=0)


def rendered_prompt(server, **body) -> str:
    """The prompt text the model would see for a chat body (/v1/chat/completions/render)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return build_byte_tokenizer().decode(r.json()["token_ids"])


def test_the_generic_format_is_detected_and_logged(generic_server):
    assert "parser generic (the chat template has no tool support)" in generic_server.log()


def test_the_prompt_holds_the_tools_merged_into_the_system_message(generic_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = rendered_prompt(generic_server, messages=messages, tools=TOOLS_WITH_TEXT)
    assert text.count("<|im_start|>system\n") == 1
    system = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    assert system.startswith("Be brief.\n\n")
    for tool in TOOLS_WITH_TEXT:  # each definition, as JSON, whole
        fn = tool["function"]
        shown = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        assert json.dumps(shown) in system
    assert "Weather now, by city." in system
    assert '{"tool_call": {"name": "<tool name>"' in system and "plain text" in system
    forced = rendered_prompt(generic_server, tools=TOOLS, tool_choice=NAMED)
    assert "<|im_start|>system\n" in forced and "Call the tool get_time now." in forced
    assert "get_weather" not in rendered_prompt(generic_server, tools=TOOLS, tool_choice="none")


def test_required_and_named_return_valid_calls_whole_and_streamed(gclient):
    for kw in [
        dict(tool_choice="required", seed=7, temperature=1.0),
        dict(tool_choice="required", seed=3, temperature=1.0, parallel_tool_calls=False),
        dict(tool_choice=NAMED, seed=1, temperature=1.0),
    ]:
        whole = chat(gclient, **kw).choices[0]
        check_calls(whole.message.tool_calls)
        assert whole.message.content is None
        named = kw["tool_choice"] == NAMED
        assert whole.finish_reason == ("stop" if named else "tool_calls")
        if named or kw.get("parallel_tool_calls") is False:
            assert len(whole.message.tool_calls) == 1
        if named:
            assert whole.message.tool_calls[0].function.name == "get_time"
        streamed, reasons = collect_stream(chat(gclient, stream=True, **kw))
        assert reasons == [whole.finish_reason]
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls
        ]


def test_auto_is_a_call_or_plain_text(gclient):
    """The grammar lets "auto" open with '{' only for a call: pushed to '{' it calls, pushed
    away from it it answers in text; streamed as whole."""
    call_kw = dict(logit_bias={BRACE: 30.0, **EOS_BIAS}, seed=2, temperature=1.0)
    c = chat(gclient, **call_kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    check_calls(c.message.tool_calls)
    streamed, reasons = collect_stream(chat(gclient, stream=True, **call_kw))
    assert reasons == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in streamed] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls
    ]
    text_kw = dict(logit_bias={BRACE: -100.0}, max_tokens=12, temperature=0.0)
    t = chat(gclient, **text_kw).choices[0]
    assert t.message.tool_calls is None and t.message.content and t.finish_reason == "length"
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in chat(gclient, stream=True, **text_kw)
        if ch.choices
    ]
    assert "".join(pieces) == t.message.content


def test_history_with_tool_results_round_trips(gclient, generic_server):
    """A call the server returned goes back as history with its result: the model sees the
    call as the JSON it wrote and the result as a user turn; the next turn is served."""
    tools = TOOLS[:1]  # room in the tiny model's 1024 positions
    first = chat(gclient, tools=tools, tool_choice="required", parallel_tool_calls=False, seed=7)
    [call] = first.choices[0].message.tool_calls
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    text = rendered_prompt(generic_server, messages=history, tools=tools)
    written = f'{{"tool_call": {{"name": "{call.function.name}", "arguments": '
    assert f"<|im_start|>assistant\n{written}{call.function.arguments}}}}}<|im_end|>" in text
    response = {"tool_response": {"name": call.function.name, "content": "sunny"}}
    assert f"<|im_start|>user\n{json.dumps(response)}<|im_end|>" in text
    assert "<|im_start|>tool" not in text
    second = chat(gclient, messages=history, tools=tools, max_tokens=8, temperature=0.0)
    second = second.choices[0]
    assert second.finish_reason in ("stop", "length", "tool_calls")
    wait_idle(generic_server.url)


def test_responses_function_call_on_a_template_without_tools(gclient):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    r = gclient.responses.create(
        model="tiny", input="weather?", tools=[tool], tool_choice="required",
        max_output_tokens=300, extra_body={"logit_bias": EOS_BIAS}, store=False,
    )  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in r.output)
    for item in calls:
        jsonschema.validate(json.loads(item.arguments), PARAMS[item.name])


@pytest.mark.slow
def test_smollm2_forced_call_has_arguments_in_the_schema():
    """The real SmolLM2 (its template ignores `tools`): a forced call parses and validates."""
    server = ServerProcess(None, "--dtype", "float32").wait_ready()
    try:
        assert "parser generic (the chat template has no tool support)" in server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=messages, tools=TOOLS,
                tool_choice=choice, temperature=0.0, max_tokens=100,
            )  # fmt: skip
            [call, *_] = r.choices[0].message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
            assert r.choices[0].message.content is None
    finally:
        server.stop()
