"""Unmodified agent frameworks against a server started with NO tool flags (the tool parser is
read from the chat template): openai-agents, instructor, pydantic-ai, LangChain and LiteLLM.

The tiny random model's answers are noise, so each case checks what the server owes: the request
is accepted, forced calls are valid calls of the declared tools, structured answers validate, and
the replies have OpenAI's shapes. The real-model versions are marked `slow`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.conftest import serve_float32, wait_idle
from tests.test_tool_calling import WEATHER

# EOS (<|im_end|>, id 2) wherever a grammar allows it, so random weights end their answers.
EOS_BIAS = {"2": 50.0}


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # bounded output: no extra keys to ramble in

    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def plain_server(tools_model_dir):
    yield from serve_float32(tools_model_dir, "tiny")


@pytest.fixture(scope="module")
def pclient(plain_server):
    return openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x", max_retries=0)


CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "City", "strict": True, "schema": {
        "type": "object",
        "properties": {"zeta": {"type": "integer", "maximum": 9}, "alpha": {"enum": ["a", "b"]}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }},
}  # fmt: skip


def test_tools_with_no_tool_choice_and_no_flags(pclient, plain_server):
    assert "tool calling: auto, parser hermes" in plain_server.log()
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = pclient.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0.0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_format_with_tools(pclient):
    """required / named force the call (no 400), "auto" is calls-or-schema, the schema's key
    order is kept, a call cut by max_tokens leaves no markup and content is null."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
    kw |= dict(response_format=CITY_FORMAT, logit_bias=EOS_BIAS, max_tokens=120, seed=3)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        m = pclient.chat.completions.create(tool_choice=choice, **kw).choices[0].message
        assert m.content is None and [c.function.name for c in m.tool_calls] == ["get_weather"]
        json.loads(m.tool_calls[0].function.arguments)
    for seed in range(3):
        c = pclient.chat.completions.create(tool_choice="auto", **{**kw, "seed": seed}).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert c.message.tool_calls[0].function.name == "get_weather"
        else:
            assert list(json.loads(c.message.content)) == ["zeta", "alpha"]
    plain = pclient.chat.completions.create(**{**kw, "tools": None}).choices[0].message
    assert list(json.loads(plain.content)) == ["zeta", "alpha"]  # not sorted
    cut = pclient.chat.completions.create(
        tool_choice="required", **{**kw, "max_tokens": 6}
    ).choices[0]
    assert cut.finish_reason == "length" and cut.message.content in (None, "")  # no markup


def test_openai_agents_tools_output_type_required(plain_server):
    """Agent with a tool, output_type and tool_choice "required", on Chat Completions and on
    Responses: the forced call reaches the tool (before, 400); then the loop goes on."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import AgentsException

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=plain_server.url + "/v1", api_key="x", max_retries=0)
    seen = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    bias = {"logit_bias": EOS_BIAS}
    settings = ModelSettings(
        tool_choice="required", max_tokens=100, extra_body=bias, parallel_tool_calls=False
    )

    async def run(model_class) -> None:
        seen.clear()
        model = model_class("tiny", client)
        agent = Agent(
            name="a", model=model, tools=[get_weather], output_type=City, model_settings=settings
        )
        try:
            result = await Runner.run(agent, "weather in Oslo?", max_turns=2)
            assert isinstance(result.final_output, City)
        except AgentsException:  # random weights need not settle in 2 turns (a 1024 context)
            pass
        assert seen, model_class.__name__

    async def both() -> None:
        await run(OpenAIChatCompletionsModel)
        await run(OpenAIResponsesModel)

    asyncio.run(both())
    wait_idle(plain_server.url)


def test_instructor_modes(plain_server):
    """Mode.TOOLS (a named tool), JSON_SCHEMA (response_format) and RESPONSES_TOOLS (a named
    tool on /v1/responses): each returns a validated City."""
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(
            openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x"), mode=mode
        )
        city = client.chat.completions.create(
            model="tiny", response_model=City, max_retries=0, max_tokens=100,
            messages=[{"role": "user", "content": "a city"}], logit_bias=EOS_BIAS,
        )  # fmt: skip
        assert isinstance(city, City), mode
    client = instructor.from_openai(
        openai.OpenAI(base_url=plain_server.url + "/v1", api_key="x"),
        mode=instructor.Mode.RESPONSES_TOOLS,
    )
    city = client.responses.create(
        model="tiny", response_model=City, max_retries=0, max_output_tokens=100,
        input=[{"role": "user", "content": "a city"}],
    )  # fmt: skip
    assert isinstance(city, City)


def test_langchain_bind_tools_and_structured_output(plain_server):
    """bind_tools with "auto" (no flags needed now) and with_structured_output in its three
    methods (function_calling, json_schema, json_mode)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        model="tiny", base_url=plain_server.url + "/v1", api_key="x", max_retries=0,
        max_tokens=100, temperature=1.0, logit_bias=EOS_BIAS,
    )  # fmt: skip
    reply = llm.bind_tools([get_weather]).invoke("weather in Oslo?")
    assert isinstance(reply.content, str) and isinstance(reply.tool_calls, list)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather?")
    # a random string argument may run past max_tokens: LangChain files it as invalid
    assert [c["name"] for c in forced.tool_calls + forced.invalid_tool_calls] == ["get_weather"]
    llm = llm.model_copy(update={"max_tokens": 400})  # JSON layout whitespace, random weights
    assert isinstance(llm.with_structured_output(City, method="function_calling").invoke("x"), City)
    for schema, method in ((City, "json_schema"), (None, "json_mode")):
        try:  # accepted; random weights may not close the JSON in time (LangChain then raises)
            out = llm.with_structured_output(schema, method=method).invoke("a JSON object")
            assert isinstance(out, schema or dict)
        except openai.LengthFinishReasonError as e:
            assert e.completion.choices[0].finish_reason == "length"


def test_pydantic_ai_tool_and_output(plain_server):
    """An Agent with a tool and an output type: its requests (tools, tool_choice "required"
    for the output tool) are accepted; a random model may not finish within the limit."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import AgentRunError, UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=plain_server.url + "/v1", api_key="x")
    settings = ModelSettings(max_tokens=100, logit_bias={2: 50}, parallel_tool_calls=False)
    agent = Agent(OpenAIChatModel("tiny", provider=provider), output_type=City,
                  model_settings=settings, retries=0)  # fmt: skip
    calls = []

    @agent.tool_plain
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    try:
        result = agent.run_sync("weather in Oslo?", usage_limits=UsageLimits(request_limit=2))
        assert isinstance(result.output, City)
    except (AgentRunError, UnexpectedModelBehavior) as e:
        assert "400" not in str(e) and "Bad Request" not in str(e), e


def test_litellm_tools_and_required(plain_server):
    import litellm

    kw = dict(
        model="openai/tiny", api_base=plain_server.url + "/v1", api_key="x", max_tokens=100,
        messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], logit_bias=EOS_BIAS,
    )  # fmt: skip
    auto = litellm.completion(**kw)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = litellm.completion(tool_choice="required", parallel_tool_calls=False, **kw)
    [call] = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and forced.choices[0].message.content is None
    wait_idle(plain_server.url)


@pytest.fixture(scope="module")
def smol_server():
    """The default model (SmolLM2-135M-Instruct, whose template has no tool support), no flags."""
    from tests.conftest import ServerProcess

    server = ServerProcess(None, "--dtype", "float32").wait_ready()
    yield server
    server.stop()


@pytest.mark.slow
def test_openai_agents_loop_and_previous_response_id_on_the_default_model(smol_server):
    """A full agent loop (forced call, tool result, final answer in the output type) on Chat
    Completions, and `previous_response_id` turns on Responses, on the real default model."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import AgentsException

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny, 21 C"

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0)
        settings = ModelSettings(tool_choice="required", max_tokens=200, parallel_tool_calls=False)
        agent = Agent(
            name="a",
            instructions="Use get_weather, then answer.",
            model=OpenAIChatCompletionsModel("SmolLM2-135M-Instruct", client),
            tools=[get_weather],
            output_type=City,
            model_settings=settings,
        )
        try:
            result = await Runner.run(agent, "weather in Oslo?", max_turns=4)
            assert isinstance(result.final_output, City)
        except AgentsException:  # a 135M model may call again instead of answering
            pass
        assert seen
        chat = Agent(
            name="b",
            instructions="Answer in one short sentence.",
            model=OpenAIResponsesModel("SmolLM2-135M-Instruct", client),
            model_settings=ModelSettings(max_tokens=400, temperature=0.0),
        )
        first = await Runner.run(chat, "My name is Ada.")
        second = await Runner.run(
            chat, "What is my name?", previous_response_id=first.last_response_id
        )
        assert first.last_response_id and second.last_response_id != first.last_response_id
        stored = await client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id
        assert stored.usage.input_tokens > 12  # the first turn is in the prompt

    asyncio.run(run())
