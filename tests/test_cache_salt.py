"""vLLM's `cache_salt` request field through the server: requests share prefix-cache blocks only
under equal salts (seen in vllm:prefix_cache_hits_total), bad salts get a 400 naming the field,
and the render endpoints echo it."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Say something"}]


def _hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def _prompt() -> str:
    """A fresh prompt of several 16-token blocks, cached by nobody yet."""
    return f"{uuid.uuid4().hex} " + "the tenant keeps its own prefix cache " * 4


def _new_hits(url: str, send) -> float:
    """Prefix-cache hits (tokens) of one request: the counter's rise, once the loop has seen it."""
    before = _hits(url)
    send()
    time.sleep(0.05)
    return _hits(url) - before


def test_completions_share_blocks_only_under_the_same_salt(client, tiny_server):
    prompt, url = _prompt(), tiny_server.url

    def complete(salt: str | None):
        extra = {"cache_salt": salt} if salt is not None else None
        return lambda: client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body=extra
        )

    assert _new_hits(url, complete("tenant-a")) == 0
    assert _new_hits(url, complete("tenant-a")) >= 32  # the same salt: a hit
    assert _new_hits(url, complete("tenant-b")) == 0  # another tenant: nothing shared
    assert _new_hits(url, complete(None)) == 0  # unsalted never meets a salted block
    assert _new_hits(url, complete(None)) >= 32
    assert _new_hits(url, complete("tenant-b")) >= 32


def test_chat_and_responses_carry_the_salt(client, tiny_server):
    content, url = _prompt(), tiny_server.url
    messages = [{"role": "user", "content": content}]

    def chat(salt: str):
        return lambda: client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )

    assert _new_hits(url, chat("a")) == 0
    assert _new_hits(url, chat("a")) >= 32
    assert _new_hits(url, chat("b")) == 0

    fresh = _prompt()

    def respond(salt: str):
        return lambda: client.responses.create(
            model="tiny", input=fresh, max_output_tokens=1,
            extra_body={"cache_salt": salt},
        )  # fmt: skip

    assert _new_hits(url, respond("a")) == 0
    assert _new_hits(url, respond("a")) >= 32
    assert _new_hits(url, respond("c")) == 0


@pytest.mark.parametrize(
    ("endpoint", "salt"),
    [("completions", ""), ("chat", 5), ("responses", "a/b"), ("completions", "x" * 129)],
)
def test_a_bad_salt_is_a_400_naming_cache_salt(client, endpoint, salt):
    extra = {"cache_salt": salt}
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body=extra)
        elif endpoint == "chat":
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra
            )
        else:
            client.responses.create(model="tiny", input="hi", extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == "cache_salt"
    assert "cache_salt" in e.value.message
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=1)  # still serving
    assert ok.choices[0].finish_reason is not None


def test_render_echoes_the_salt(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as http:
        body = {"model": "tiny", "prompt": ["a", "b"], "cache_salt": "tenant-a"}
        items = http.post("/v1/completions/render", json=body).json()
        assert [i["cache_salt"] for i in items] == ["tenant-a", "tenant-a"]
        chat = {"model": "tiny", "messages": MESSAGES, "cache_salt": "tenant-b"}
        assert http.post("/v1/chat/completions/render", json=chat).json()["cache_salt"] == "tenant-b"
        bad = http.post("/v1/chat/completions/render", json={**chat, "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
