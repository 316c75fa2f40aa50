"""Structured outputs through the OpenAI surface: json_schema, json_object, regex, choice,
grammar, vLLM's structured_outputs / guided_* fields, parse(), and every refusal."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import wait_idle

# Strings, arrays and numbers are bounded so a random-weight model finishes inside max_tokens.
S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": S, "id": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["name", "id"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"const": 3}},
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 5}]},
    {
        "type": "object",
        "properties": {"req": {"type": "boolean"}, "opt": S},
        "required": ["req"],
        "additionalProperties": False,
    },
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
            "point": {
                "type": "array",
                "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}],
                "items": False,
            },
        },
        "required": ["tags", "point"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "leaf": {
                "type": "object",
                "properties": {"v": {"type": "boolean"}},
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left", "right"],
        "additionalProperties": False,
    },
    {"type": "number", "minimum": -1, "maximum": 1},
]


def json_schema_format(schema: dict, name: str = "out") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="tiny", **kw)


def test_json_schema_outputs_validate(tclient):
    """A dozen schemas, sampled at temperature 1 with seeds, all valid and all finished."""
    for i, schema in enumerate(SCHEMAS):
        r = chat(tclient, response_format=json_schema_format(schema), seed=i, temperature=1.0)
        c = r.choices[0]
        assert c.finish_reason == "stop", (schema, c.message.content)
        check_json(c.message.content, schema)


def test_json_schema_n3_streamed_and_not(tclient):
    schema = SCHEMAS[1]
    fmt = json_schema_format(schema)
    r = chat(tclient, response_format=fmt, n=3, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    full = [c.message.content for c in r.choices]
    for text in full:
        check_json(text, schema)
    stream = chat(tclient, response_format=fmt, n=3, seed=5, temperature=1.0, stream=True)
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == full and reasons == ["stop"] * 3  # seeded: streamed equals whole


def test_batched_with_unconstrained_requests(tclient):
    """Constrained and free requests in the same steps: each gets only its own mask."""
    results: dict[int, object] = {}

    def run(i: int) -> None:
        if i % 2:
            results[i] = chat(tclient, max_tokens=30, temperature=0.0)
        else:
            fmt = json_schema_format(SCHEMAS[i % len(SCHEMAS)])
            results[i] = chat(tclient, response_format=fmt, seed=i, temperature=1.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8
    for i, r in results.items():
        if i % 2 == 0:
            check_json(r.choices[0].message.content, SCHEMAS[i % len(SCHEMAS)])
    free = {results[i].choices[0].message.content for i in (1, 3, 5, 7)}
    assert len(free) == 1  # greedy and unconstrained: the same text whatever ran beside it
    assert free == {chat(tclient, max_tokens=30, temperature=0.0).choices[0].message.content}


def test_json_object_and_completions(tclient, tools_server):
    r = chat(
        tclient,
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=1,
        temperature=1.0,
        logit_bias=closing_bias(tools_server.url),
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = tclient.completions.create(
        model="tiny", prompt="x", max_tokens=40, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.choices[0].text)
    assert c.choices[0].finish_reason == "stop"


def closing_bias(url: str) -> dict[str, float]:
    """Favour the bytes that close JSON values, so free-form JSON ends quickly."""
    body = {"prompt": '"}]', "add_special_tokens": False}
    ids = httpx.post(url + "/tokenize", json=body, timeout=10).json()["tokens"]
    return {str(t): 20.0 for t in ids}


@pytest.mark.parametrize(
    "extra,check",
    [
        (
            {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
            lambda t: t in {"yes", "no", "maybe"},
        ),
        ({"guided_choice": ["left", "right"]}, lambda t: t in {"left", "right"}),
        (
            {"structured_outputs": {"regex": r"\d{2}:\d{2}"}},
            lambda t: re.fullmatch(r"\d{2}:\d{2}", t),
        ),
        ({"guided_regex": "(ab|cd)+!"}, lambda t: re.fullmatch("(ab|cd)+!", t)),
        ({"structured_outputs": {"json": {"type": "boolean"}}}, lambda t: t in ("true", "false")),
        ({"guided_json": {"enum": [1, 2]}}, lambda t: t in ("1", "2")),
        (
            {"structured_outputs": {"grammar": 'start: "k" ("x" | "y")'}},
            lambda t: t in ("kx", "ky"),
        ),
        ({"guided_grammar": 'root ::= "p" [0-9]'}, lambda t: re.fullmatch("p[0-9]", t)),
    ],
)
def test_vllm_fields(tclient, extra, check):
    for seed in range(3):
        r = chat(tclient, extra_body=extra, seed=seed, temperature=1.0, max_tokens=60)
        text = r.choices[0].message.content
        assert check(text), text
        assert r.choices[0].finish_reason == "stop"


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})
    age: int = Field(ge=0, le=30)


def test_parse_returns_the_pydantic_object(tclient):
    r = tclient.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "pet"}],
        response_format=Pet,
        max_tokens=200,
        seed=3,
        temperature=1.0,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.age <= 30


def test_max_tokens_inside_the_grammar_is_length(tclient):
    r = chat(
        tclient,
        response_format=json_schema_format({"type": "string"}),
        max_tokens=5,
        temperature=0.0,
    )
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content) <= 5


def test_prefix_hit_keeps_the_grammar(tclient):
    """The same long prompt twice: the second hits the prefix cache, output still valid."""
    messages = [{"role": "user", "content": "z" * 200}]
    fmt = json_schema_format(SCHEMAS[3])
    first = chat(tclient, messages=messages, response_format=fmt, temperature=0.0)
    second = chat(tclient, messages=messages, response_format=fmt, temperature=0.0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == second.choices[0].message.content
    check_json(second.choices[0].message.content, SCHEMAS[3])


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frob"}},
            }
        },
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {}}},
            }
        },
        "response_format",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
]


@pytest.mark.parametrize("kw,param", BAD)
def test_bad_grammars_are_400_naming_the_field(tclient, tools_server, kw, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            chat(tclient, stream=stream, **kw)
        assert e.value.body["param"] == param
    assert "not" not in str(kw) or "keyword: not" in e.value.body["message"]


def test_slow_schema_is_refused_in_time_and_the_server_keeps_serving(tclient, tools_server):
    schema = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(6000)
        ]
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "response_format": json_schema_format(schema),
    }
    with httpx.stream(
        "POST", tools_server.url + "/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 400
        assert "longer than" in json.loads(r.read())["error"]["message"]
    assert httpx.get(tools_server.url + "/health").status_code == 200
    assert chat(tclient, max_tokens=3).choices[0].finish_reason == "length"
    wait_idle(tools_server.url)


def test_no_block_leaks_after_refusals_and_grammars(tclient, tools_server):
    g = wait_idle(tools_server.url)
    assert g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"]
