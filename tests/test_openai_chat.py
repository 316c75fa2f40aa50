"""POST /v1/chat/completions, /tokenize, /detokenize, /v1/models, /version on loopback."""

from __future__ import annotations

import json

import httpx
from conftest import CYCLE_TEXT, openai_schema_validator, wire

CYCLE = CYCLE_TEXT  # the cycle model enters its cycle after the template's final "\n"
MESSAGES = [{"role": "user", "content": "Say something"}]


def chat(client, model="tiny", messages=MESSAGES, **kw):
    kw.setdefault("max_tokens", 12)
    extra = kw.pop("extra_body", {})
    extra.setdefault("ignore_eos", True)
    return client.chat.completions.create(model=model, messages=messages, extra_body=extra, **kw)


def stream_contents(chunks) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            out[choice.index] = out.get(choice.index, "") + (choice.delta.content or "")
    return out


def check_stream_rules(chunks, n: int) -> None:
    """Role first and once per choice, one finish_reason per choice and nothing after it."""
    validator = openai_schema_validator("CreateChatCompletionStreamResponse")
    roles, finished = set(), set()
    for c in chunks:
        validator.validate(wire(c))
        for choice in c.choices:
            assert choice.index not in finished
            if choice.delta.role is not None:
                assert choice.index not in roles
                roles.add(choice.index)
            else:
                assert choice.index in roles
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert roles == finished == set(range(n))
    assert len({(c.id, c.created) for c in chunks}) == 1


def test_chat_greedy_stream_equals_full(client):
    full = chat(client, temperature=0)
    openai_schema_validator("CreateChatCompletionResponse").validate(wire(full))
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(chat(client, temperature=0, stream=True))
    check_stream_rules(chunks, 1)
    assert stream_contents(chunks) == {0: full.choices[0].message.content}


def test_chat_n_streamed_and_not_with_usage(client):
    kw = dict(temperature=1.0, seed=5, n=2, max_completion_tokens=8)
    full = chat(client, **kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 16
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    check_stream_rules(chunks[:-1], 2)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert stream_contents(chunks) == {c.index: c.message.content for c in full.choices}


def test_max_tokens_and_max_completion_tokens(client):
    assert chat(client, max_tokens=3).usage.completion_tokens == 3
    resp = chat(client, max_tokens=9, max_completion_tokens=4)  # the newer name wins
    assert resp.usage.completion_tokens == 4


def test_chat_template_applied(client, tiny_server):
    resp = chat(client, max_tokens=1)
    rendered = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
    tok = httpx.post(tiny_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    specials = 2 * len("<|im_start|>") + len("<|im_end|>")  # each is one token
    assert resp.usage.prompt_tokens == tok["count"] == len(rendered.encode()) - specials + 3


def test_chat_stop_string_streamed_and_not(cycle):
    full = chat(cycle, "cycle", temperature=0, max_tokens=24)
    assert full.choices[0].message.content == CYCLE * 2
    stopped = chat(cycle, "cycle", temperature=0, max_tokens=24, stop=["世"])
    assert stopped.choices[0].message.content == "aé🎉"
    streamed = list(chat(cycle, "cycle", temperature=0, max_tokens=24, stop=["世"], stream=True))
    assert stream_contents(streamed) == {0: "aé🎉"}
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs_bytes_rebuild_the_text(cycle):
    lp = chat(cycle, "cycle", temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 12 and all(len(e.top_logprobs) == 2 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode() == CYCLE
    assert all(e.token == e.top_logprobs[0].token for e in content)  # greedy = best


def test_chat_utf8_stream_strict(cycle_server):
    body = {
        "model": "cycle",
        "messages": MESSAGES,
        "max_tokens": 36,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", cycle_server.url + "/v1/chat/completions", json=body, timeout=60
    ) as r:
        raw = b"".join(r.iter_bytes())
    decoded = raw.decode("utf-8", errors="strict")
    events = [json.loads(x[6:]) for x in decoded.split("\n\n") if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events]
    assert "".join(deltas) == CYCLE * 3 and not any("\ufffd" in d for d in deltas)


def test_tokenize_detokenize_models_version(client, tiny_server):
    url = tiny_server.url
    tok = httpx.post(url + "/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    body = tok.json()
    assert body["count"] == 6 and body["max_model_len"] == 1024 and len(body["tokens"]) == 6
    assert len(body["token_strs"]) == 6
    detok = httpx.post(url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert detok == {"prompt": "héllo"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    models = client.models.list()
    openai_schema_validator("ListModelsResponse").validate(wire(models))
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(url + "/version").json()["version"]
