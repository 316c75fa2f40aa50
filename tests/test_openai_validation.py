"""Every refusal: status, OpenAI error object with `param`, no SSE, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from conftest import openai_schema_validator

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (endpoint, body, status, param)
    (C, {"prompt": "x" * 1100}, 400, "prompt"),
    (C, {"prompt": "x" * 1000, "max_tokens": 100}, 400, "prompt"),
    (C, {"prompt": "x" * 1024, "max_tokens": None}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 129}, 400, "n"),
    (C, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    (C, {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": ["ok", ""]}, 400, "prompt"),
    (C, {"prompt": [5, 259]}, 400, "prompt"),
    (C, {"prompt": [[5], [-1]]}, 400, "prompt"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    (C, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (C, {"prompt": 3.5}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "hi", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    (C, {"prompt": "hi", "guided_regex": "(a+"}, 400, "guided_regex"),
    (C, {"prompt": "hi", "model": "nope"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].image_url"),  # a text-only model: "does not take images"
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 2000}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 1100}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "temperature": 3}, 400, "temperature"),
    (CHAT, {"messages": MSG, "stop": ["", "x"]}, 400, "stop"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "guided_json": {"type": "frob"}}, 400, "guided_json"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


def check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")  # never an SSE stream
    body = r.json()
    openai_schema_validator("ErrorResponse").validate(body)
    assert body["error"]["param"] == param
    assert body["error"]["message"] and body["error"]["type"]
    assert "/" + "work" not in r.text and "site-packages" not in r.text and ".py" not in r.text
    assert len(r.content) < 1000  # inputs are never echoed back
    return body


@pytest.mark.parametrize("endpoint, body, status, param", CASES)
def test_refusals(http, endpoint, body, status, param):
    check_error(http.post(endpoint, json={"model": "tiny", **body}), status, param)


@pytest.mark.parametrize(
    "endpoint, body, status, param", [c for c in CASES if "stream_options" not in c[1]]
)
def test_refusals_come_before_any_stream(http, endpoint, body, status, param):
    check_error(http.post(endpoint, json={"model": "tiny", **body, "stream": True}), status, param)


def test_context_length_message_keeps_vllm_wording(http):
    body = check_error(http.post(C, json={"prompt": "x" * 1000, "max_tokens": 100}), 400, "prompt")
    assert body["error"]["message"].startswith(
        "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens"
    )


@pytest.mark.parametrize(
    "endpoint, body, param, sent, accepted",
    [
        (C, {"prompt": "hi", "best_of": 3}, "best_of", "best_of 3", "accepted: 1"),
        (C, {"prompt": "hi", "suffix": "end"}, "suffix", "3 characters", "leave it unset"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages",
            "'input_audio'",
            "accepted: text",
        ),
        (
            CHAT,
            {"messages": MSG, "response_format": {"type": "xml"}},
            "response_format",
            "'xml'",
            "accepted: text, json_object, json_schema",
        ),
        (
            C,
            {"prompt": "hi", "structured_outputs": {"lark": "start: x"}},
            "structured_outputs",
            "structured_outputs.lark",
            "accepted: json, regex, choice, grammar",
        ),
    ],
)
def test_refused_types_name_the_value_sent_and_the_values_accepted(
    http, endpoint, body, param, sent, accepted
):
    message = check_error(http.post(endpoint, json=body), 400, param)["error"]["message"]
    assert sent in message and accepted in message, message


def test_huge_and_malformed_inputs_are_small_400s(http):
    check_error(http.post(C, json={"prompt": "x" * 200_000}), 400, "prompt")
    check_error(
        http.post(C, json={"prompt": "hi", "max_tokens": "9" * 50_000 + "x"}), 400, "max_tokens"
    )
    r = http.post(C, content=b"{not json", headers={"content-type": "application/json"})
    check_error(r, 400, None)
    check_error(http.post(C, json=["a", "list"]), 400, None)


def test_server_keeps_serving_after_refusals(http):
    for endpoint, body, _, _ in CASES[:5]:
        http.post(endpoint, json=body)
    ok = http.post(C, json={"model": "tiny", "prompt": "still here", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
