"""POST /v1/completions/render and /v1/chat/completions/render (vLLM's GenerateRequest shape):
the token ids equal /tokenize's, the sampling params are the ones generation would run, and
bad input gets the error the generation endpoints give."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Say something"}]
# vLLM's GenerateRequest fields (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)
GENERATE_REQUEST_KEYS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "return_token_ids", "output_mode", "stream", "stream_options", "cache_salt",
    "priority", "kv_transfer_params", "ec_transfer_params",
}


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


def test_completions_render_matches_tokenize_for_each_prompt(http):
    prompts = ["Hello there", "A second, longer prompt"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 7, "temperature": 0.5,
            "stop": ["\n"], "seed": 3}
    r = http.post("/v1/completions/render", json=body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, list) and len(rendered) == 2
    for i, (item, prompt) in enumerate(zip(rendered, prompts)):
        assert set(item) == GENERATE_REQUEST_KEYS
        tokens = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert item["token_ids"] == tokens
        assert item["request_id"] == f"cmpl-abc-{i}" and item["model"] == "tiny"
        sp = item["sampling_params"]
        assert (sp["max_tokens"], sp["temperature"], sp["stop"], sp["seed"]) == (7, 0.5, ["\n"], 3)
        assert item["output_mode"] == "tokens" and item["stream"] is False
    one = http.post("/v1/completions/render", json={"prompt": [5, 6, 7]}).json()
    assert len(one) == 1 and one[0]["token_ids"] == [5, 6, 7]
    assert one[0]["sampling_params"]["max_tokens"] == 16  # OpenAI's completions default


def test_chat_render_matches_tokenize_of_the_messages(http):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    r = http.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    item = r.json()
    assert GENERATE_REQUEST_KEYS <= set(item)
    assert {"reasoning_ended", "reasoning_parser_kwargs"} <= set(item)
    tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert item["token_ids"] == tokens
    assert item["request_id"].startswith("chatcmpl-") and item["stream"] is True
    assert item["sampling_params"]["max_tokens"] == 5
    # no max_tokens: what the context leaves, as generation would run it
    left = http.post("/v1/chat/completions/render", json={"messages": MESSAGES}).json()
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert left["sampling_params"]["max_tokens"] == max_model_len - len(tokens)


def test_render_refuses_what_generation_refuses(http):
    r = http.post("/v1/completions/render", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.post("/v1/completions/render", json={"prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = http.post("/v1/completions/render", json={"prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    too_long = [{"role": "user", "content": "x" * 5000}]
    r = http.post("/v1/chat/completions/render", json={"messages": too_long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert http.get("/health").status_code == 200
