"""server/serving_* on hand-built engine outputs: the OpenAI shapes, proven without the engine.

A scripted AsyncEngine facade (conftest.ScriptedEngine) yields RequestOutputs with logprobs,
prompt logprobs and stop reasons exactly as the engine contract describes them; the official
openai client talks to the app in-process through Starlette's TestClient.
"""

from __future__ import annotations

import json

import openai
import pytest
from conftest import SCRIPTED_TEXT, ScriptedEngine, build_byte_tokenizer, openai_schema_validator
from fastapi.testclient import TestClient

from server.app import build_app
from server.metrics import Metrics

OUTPUT_TEXT = SCRIPTED_TEXT


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture()
def scripted(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture()
def client(scripted, tokenizer):
    app = build_app(scripted, Metrics("fake"))
    http = TestClient(app, raise_server_exceptions=False)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def wire(obj) -> dict:
    """The JSON the server sent (the client fills absent fields with None)."""
    return obj.model_dump(mode="json", exclude_unset=True)


def _strings(tokenizer, ids):
    return [tokenizer.decode([t]) for t in ids]


def test_completion_logprobs_legacy_shape(client, tokenizer, scripted):
    resp = client.completions.create(model="fake", prompt="ab", max_tokens=8, logprobs=2)
    openai_schema_validator("CreateCompletionResponse").validate(wire(resp))
    choice = resp.choices[0]
    assert choice.text == OUTPUT_TEXT and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "!"
    lp = choice.logprobs
    ids = scripted.output_ids
    assert lp.tokens == _strings(tokenizer, ids)
    assert lp.token_logprobs == [-0.25] * len(ids)
    assert all(len(top) == 2 for top in lp.top_logprobs)  # sampled token is among the top 2
    assert lp.text_offset == [0, 1, 2, 3, 4, 5, 6, 7]  # cumulative lengths of token strings
    assert scripted.requests[0][2].logprobs == 2 and scripted.requests[0][2].prompt_logprobs is None


def test_completion_logprobs_zero_still_reports_sampled_token(client, scripted):
    resp = client.completions.create(model="fake", prompt="ab", max_tokens=3, logprobs=0)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.25] * 3
    assert all(len(top) == 1 for top in lp.top_logprobs)


def test_echo_with_logprobs_prepends_prompt_with_null_first_entry(client, tokenizer, scripted):
    resp = client.completions.create(
        model="fake", prompt="xyz", max_tokens=2, echo=True, logprobs=1
    )
    choice = resp.choices[0]
    assert choice.text == "xyz" + "h\u00e9"[:1]  # "h", then half of "é" is held back
    lp = choice.logprobs
    assert lp.tokens[:3] == ["x", "y", "z"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.25] * 4
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert scripted.requests[0][2].prompt_logprobs == 1
    assert resp.choices[0].finish_reason == "length"


def test_echo_token_id_prompt_decodes_prompt(client, tokenizer):
    ids = tokenizer.encode("q?", add_special_tokens=False)
    resp = client.completions.create(model="fake", prompt=ids, max_tokens=1, echo=True)
    assert resp.choices[0].text == "q?h"


def test_stream_equals_full_and_usage_comes_last(client, scripted):
    kw = dict(model="fake", prompt=["ab", "cde"], max_tokens=8, n=2, logprobs=1)
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    validator = openai_schema_validator("CreateCompletionResponse", allow_null=("finish_reason",))
    for c in chunks:
        validator.validate(wire(c))
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    streamed: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    reasons: dict[int, list] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        reasons.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in full.choices:
        assert streamed[choice.index] == choice.text == OUTPUT_TEXT
        assert tokens[choice.index] == choice.logprobs.tokens
        assert reasons[choice.index][-1] == "stop" and set(reasons[choice.index][:-1]) == {None}
    assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens == 4 * 8
    assert full.usage.prompt_tokens_details.cached_tokens == 4  # 2 per prompt, not per choice


def test_fan_out_ids_and_seeds(client, scripted):
    client.completions.create(model="fake", prompt=["a", "b"], n=3, seed=7, max_tokens=1)
    ids = [r[0] for r in scripted.requests]
    assert [i.rsplit("-", 1)[1] for i in ids] == ["0", "1", "2", "3", "4", "5"]
    assert [r[2].seed for r in scripted.requests] == [7, 8, 9, 7, 8, 9]
    assert all(r[2].n == 1 for r in scripted.requests)


def test_chat_logprobs_shape_and_bytes(client, tokenizer, scripted):
    resp = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
        max_completion_tokens=8,
    )
    openai_schema_validator("CreateChatCompletionResponse").validate(wire(resp))
    choice = resp.choices[0]
    assert choice.message.content == OUTPUT_TEXT and choice.message.role == "assistant"
    content = choice.logprobs.content
    assert len(content) == len(scripted.output_ids)
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8") == OUTPUT_TEXT  # exact bytes, even for half characters
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert content[0].top_logprobs[0].token == "h" and content[0].logprob == -0.25


def test_chat_stream_role_first_and_one_finish_reason(client):
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    validator = openai_schema_validator("CreateChatCompletionStreamResponse")
    for c in chunks:
        validator.validate(wire(c))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    seen_role, text, finished = {}, {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        i = choice.index
        assert i not in finished, "nothing may follow a choice's finish_reason"
        if choice.delta.role is not None:
            assert i not in seen_role and text[i] == ""
            seen_role[i] = True
        text[i] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[i] = choice.finish_reason
    assert seen_role == {0: True, 1: True} and finished == {0: "stop", 1: "stop"}
    assert text == {0: OUTPUT_TEXT, 1: OUTPUT_TEXT}


def test_chat_usage_null_in_chunks_only_with_include_usage(scripted, tokenizer):
    app = build_app(scripted, Metrics("fake"))
    http = TestClient(app)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2}
    lines = http.post("/v1/chat/completions", json=body).text.split("\n\n")
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events and all("usage" not in e for e in events)
    body["stream_options"] = {"include_usage": True}
    lines = http.post("/v1/chat/completions", json=body).text.split("\n\n")
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"]
    assert lines[-2] == "data: [DONE]"


def test_chat_template_renders_messages(scripted, client, tokenizer):
    client.chat.completions.create(
        model="fake",
        messages=[
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in "AB"]},
        ],
        max_tokens=1,
    )
    prompt = tokenizer.decode(scripted.requests[0][1], skip_special_tokens=False)
    assert prompt == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nA\nB<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_max_tokens_default_fills_context(scripted, client):
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    (_, prompt_ids, params) = scripted.requests[0]
    assert params.max_tokens == 64 - len(prompt_ids)


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "text": 'h\u00e9llo "x"\n'},
        {"index": 2, "text": "", "finish_reason": "stop", "stop_reason": "</s>"},
        {"index": 1, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1e-7],
                                               "top_logprobs": [{"a": -1e-7}], "text_offset": [0]}},
    ],
)
def test_completion_chunk_envelope_renders_the_models_json(choice):
    """The stream writes head JSON + choice JSON: the same bytes as the whole chunk's model."""
    from server.openai.protocol import CompletionChoice, CompletionResponse
    from server.openai.streaming import chunk_envelope

    head = CompletionResponse(id="cmpl-1", model='m\u00e9"q', choices=[])
    before, after = chunk_envelope(head)
    c = CompletionChoice(**choice)
    assert before + c.model_dump_json() + after == (
        head.model_copy(update={"choices": [c]}).model_dump_json()
    )
