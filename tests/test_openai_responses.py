"""POST /v1/responses: plain, streamed with typed events, text.format json_schema, function
tools, stored responses (previous_response_id, GET, DELETE, input items), and refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.conftest import wait_idle

TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


def test_plain_and_instructions(tclient):
    r = tclient.responses.create(
        model="tiny", input="hello", max_output_tokens=6, instructions="be brief", temperature=0.0
    )
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    items = tclient.responses.create(
        model="tiny",
        max_output_tokens=6,
        temperature=0.0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
    )
    assert items.usage.input_tokens < r.usage.input_tokens  # no instructions: shorter prompt


def test_streamed_events_rebuild_the_response(tclient):
    events = list(
        tclient.responses.create(
            model="tiny", input="hi", max_output_tokens=8, temperature=0.0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    whole = tclient.responses.create(model="tiny", input="hi", max_output_tokens=8, temperature=0.0)
    assert whole.output_text == text


def test_text_format_json_schema(tclient):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = tclient.responses.create(
        model="tiny",
        input="ok?",
        max_output_tokens=50,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_tool_whole_and_streamed(tclient):
    kw = dict(
        model="tiny",
        input="time?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=100,
        temperature=1.0,
    )
    r = tclient.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time"
    assert calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    events = list(tclient.responses.create(stream=True, **kw))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_time"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args
    jsonschema.validate(json.loads(done[0].arguments), TOOL["parameters"])
    assert events[-1].type == "response.completed", events[-1].response.output
    # the call and its output go back as items
    follow = tclient.responses.create(
        model="tiny",
        max_output_tokens=3,
        temperature=0.0,
        tools=[TOOL],
        input=[
            {"role": "user", "content": "time?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_time",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "noon"},
        ],
    )
    assert follow.output[0].type == "message"


def test_body_is_a_valid_response(tools_server):
    body = httpx.post(
        tools_server.url + "/v1/responses",
        json={"model": "tiny", "input": "x", "max_output_tokens": 3},
        timeout=30,
    ).json()
    Response.model_validate(body)
    assert body["id"].startswith("resp_") and body["store"] is True  # OpenAI's default


def test_stored_responses_chain_and_404s(tclient, tools_server):
    """store (default): GET, input items, previous_response_id turns carry the conversation
    (not the instructions); DELETE; unknown ids get OpenAI's 404; store=false keeps nothing."""
    kw = dict(model="tiny", max_output_tokens=4, temperature=0.0)
    first = tclient.responses.create(input="hello there", instructions="be brief", **kw)
    got = tclient.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.store
    [item] = tclient.responses.input_items.list(first.id).data
    assert item.type == "message" and item.content[0].text == "hello there"
    second = tclient.responses.create(input="and?", previous_response_id=first.id, **kw)
    assert second.previous_response_id == first.id
    # the second prompt holds the first turn (input and output), without the instructions
    alone = tclient.responses.create(input="and?", store=False, **kw)
    with_first = tclient.responses.create(input=[
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and?"},
    ], store=False, **kw)  # fmt: skip
    assert second.usage.input_tokens == with_first.usage.input_tokens > alone.usage.input_tokens
    assert second.output_text == with_first.output_text
    third = tclient.responses.create(input="so?", previous_response_id=second.id, **kw)
    assert third.usage.input_tokens > second.usage.input_tokens
    # input items of a chained response: every earlier input and output, then its own input
    own = [tclient.responses.input_items.list(r.id).data[0].id for r in (first, second, third)]
    chain = tclient.responses.input_items.list(third.id, order="asc", limit=100).data
    expected = [own[0], *(o.id for o in first.output), own[1], *(o.id for o in second.output)]
    assert [i.id for i in chain] == [*expected, own[2]]
    assert [i.id for i in tclient.responses.input_items.list(third.id).data][0] == own[2]
    deleted = httpx.delete(f"{tools_server.url}/v1/responses/{first.id}", timeout=10).json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    for bad in (first.id, alone.id, "resp_nope"):
        r = httpx.get(f"{tools_server.url}/v1/responses/{bad}", timeout=10)
        assert r.status_code == 404
        assert r.json() == {"error": {
            "message": f"Response with id '{bad}' not found.",
            "type": "invalid_request_error", "param": None, "code": None,
        }}  # fmt: skip
    with pytest.raises(openai.NotFoundError) as e:
        tclient.responses.create(input="x", previous_response_id=first.id, stream=True, **kw)
    assert e.value.body["param"] == "previous_response_id"
    assert httpx.delete(f"{tools_server.url}/v1/responses/{first.id}").status_code == 404
    assert tclient.responses.retrieve(third.id).previous_response_id == second.id
    wait_idle(tools_server.url)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"input": [{"type": "image_generation_call"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
            "text.format",
        ),
    ],
)
def test_refusals(tclient, tools_server, kw, param):
    kw.setdefault("input", "x")
    with pytest.raises(openai.BadRequestError) as e:
        tclient.responses.create(model="tiny", stream=True, **kw)
    assert e.value.body["param"] == param
    wait_idle(tools_server.url)
