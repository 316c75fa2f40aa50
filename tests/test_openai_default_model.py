"""The OpenAI surface on the real default model (multi-byte BPE tokens): slow tier."""

from __future__ import annotations

import openai
import pytest
from conftest import ServerProcess, openai_schema_validator

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client():
    server = ServerProcess(None, "--dtype", "float32").wait_ready()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


def complete(client, **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0, **kw
    )


def test_stop_string_inside_a_token_streamed_equals_full(client):
    full = complete(client).choices[0].text
    assert "Paris" in full
    cut = full[: full.index("ari")]  # "ari" lies inside the " Paris" token
    stopped = complete(client, stop=["ari"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in complete(client, stop=["ari"], stream=True))
    assert streamed == cut


def test_echo_logprobs_for_scoring(client):
    """lm-eval style loglikelihood: echo + logprobs + max_tokens=1."""
    resp = complete(client, echo=True, logprobs=1, max_tokens=1)
    body = resp.model_dump(mode="json", exclude_unset=True)
    for name in ("token_logprobs", "top_logprobs"):  # OpenAI's echo null, unmodelled in its schema
        body["choices"][0]["logprobs"][name] = body["choices"][0]["logprobs"][name][1:]
    openai_schema_validator("CreateCompletionResponse").validate(body)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == resp.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: resp.usage.prompt_tokens]) == PROMPT


def test_chat_stream_equals_full_and_logprob_bytes(client):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    full = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = full.choices[0].message.content
    assert content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    entries = full.choices[0].logprobs.content  # one per token, the EOS that stopped it too
    eos = "<|im_end|>" if full.choices[0].finish_reason == "stop" else ""
    assert b"".join(bytes(e.bytes) for e in entries).decode() == content + eos
    assert len(entries) == full.usage.completion_tokens
