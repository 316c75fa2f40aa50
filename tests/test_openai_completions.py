"""POST /v1/completions end to end with the official openai client on loopback.

Two tiny servers: `tiny` (random weights: sampling parameters visibly change its output) and
`cycle` (greedy output is the known text "é🎉世жa" repeated after a prompt ending in "a", every
multi-byte character split across byte tokens: stop strings and UTF-8 streaming).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from conftest import CYCLE_TEXT, metric_value, openai_schema_validator, wire

CYCLE = CYCLE_TEXT[1:] + CYCLE_TEXT[0]  # what the cycle model writes after "a"


def complete(client, prompt="Hello there", **kw):
    kw.setdefault("max_tokens", 16)
    extra = kw.pop("extra_body", {})
    extra.setdefault("ignore_eos", True)
    model = kw.pop("model", "tiny")
    return client.completions.create(model=model, prompt=prompt, extra_body=extra, **kw)


def without_echo_null(resp) -> dict:
    """The wire body minus the echoed prompt's leading null logprob, which OpenAI returns but
    its schema's number-only lists do not model."""
    body = wire(resp)
    for choice in body["choices"]:
        for name in ("token_logprobs", "top_logprobs"):
            assert choice["logprobs"][name][0] is None
            choice["logprobs"][name] = choice["logprobs"][name][1:]
    return body


def tokenize(client, prompt: str) -> list[int]:
    url = str(client.base_url.join("/tokenize"))
    return httpx.post(url, json={"prompt": prompt}).json()["tokens"]


def text(resp, i: int = 0) -> str:
    return resp.choices[i].text


def streamed_texts(chunks) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            out[choice.index] = out.get(choice.index, "") + choice.text
    return out


# ---- sampling parameters: each one changes the output -----------------------------------------
def test_temperature_zero_is_deterministic_and_greedy(client):
    greedy = {text(complete(client, temperature=0)) for _ in range(3)}
    assert len(greedy) == 1
    sampled = {text(complete(client, temperature=1.5)) for _ in range(3)}
    assert sampled != greedy and len(sampled) > 1


@pytest.mark.parametrize(
    "kw", [{"extra_body": {"top_k": 1}}, {"top_p": 1e-6}, {"extra_body": {"min_p": 1.0}}]
)
def test_top_k_one_tiny_top_p_and_min_p_one_are_greedy(client, kw):
    greedy = text(complete(client, temperature=0))
    assert text(complete(client, temperature=1.5, **kw)) == greedy


def test_seed_reproducible_alone_and_in_a_batch(client):
    alone = [text(complete(client, temperature=1.0, seed=1234)) for _ in range(2)]
    assert alone[0] == alone[1]
    assert len({text(complete(client, temperature=1.0, seed=s)) for s in (1, 2, 3)}) > 1
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(complete, client, f"other prompt {i}", temperature=1.0) for i in range(3)
        ]
        mine = pool.submit(complete, client, temperature=1.0, seed=1234)
        assert text(mine.result()) == alone[0]
        [j.result() for j in jobs]


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}]
)
def test_penalties_change_greedy_output(client, penalty):
    base = text(complete(client, temperature=0, max_tokens=32))
    extra = {k: v for k, v in penalty.items() if k == "repetition_penalty"}
    kw = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    assert text(complete(client, temperature=0, max_tokens=32, extra_body=extra, **kw)) != base


def test_logit_bias_forces_a_token(client):
    (z,) = tokenize(client, "z")
    resp = complete(client, temperature=0, max_tokens=5, logit_bias={str(z): 100})
    assert text(resp) == "zzzzz"


def test_max_tokens_and_user_and_usage(client):
    resp = complete(client, max_tokens=7, user="someone")
    assert resp.usage.completion_tokens == 7 and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len("Hello there")
    openai_schema_validator("CreateCompletionResponse").validate(wire(resp))


def test_stop_token_ids_stop_at_first_occurrence(cycle):
    target = tokenize(cycle, "世")[0]  # the 7th byte the cycle model writes
    resp = cycle_complete(cycle, max_tokens=12, extra_body={"stop_token_ids": [target]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == target
    assert resp.usage.completion_tokens == len("é🎉".encode()) + 1


def test_ignore_eos_and_min_tokens(client, tiny_server):
    eos = "2"  # <|im_end|>
    stopped = complete(
        client, temperature=0, logit_bias={eos: 100}, extra_body={"ignore_eos": False}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    ignored = complete(client, temperature=0, max_tokens=4, logit_bias={eos: 100})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 4
    held = complete(
        client,
        temperature=0,
        logit_bias={eos: 100},
        extra_body={"ignore_eos": False, "min_tokens": 5},
    )
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens >= 5


# ---- prompts, n, streaming -------------------------------------------------------------------
def test_prompt_forms_and_choice_indexes(client):
    a, b = "first prompt", "second"
    single = [text(complete(client, p, temperature=0, max_tokens=6)) for p in (a, b)]
    ids = [tokenize(client, p) for p in (a, b)]
    for prompt in ([a, b], ids):
        resp = complete(client, prompt, temperature=0, max_tokens=6, n=2)
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        assert [c.text for c in resp.choices] == [single[0]] * 2 + [single[1]] * 2
        assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert resp.usage.completion_tokens == 24
    assert text(complete(client, ids[0], temperature=0, max_tokens=6)) == single[0]


def test_n_streamed_equals_non_streamed_with_seed(client):
    kw = dict(temperature=1.0, seed=99, n=3, max_tokens=12)
    full = complete(client, **kw)
    texts = [c.text for c in full.choices]
    assert len(set(texts)) > 1  # each choice samples on its own
    chunks = list(complete(client, stream=True, **kw))
    assert streamed_texts(chunks) == dict(enumerate(texts))
    finish = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finish) == [0, 1, 2]


def test_stream_greedy_equals_full_with_usage_last(client):
    kw = dict(temperature=0, max_tokens=20)
    full = complete(client, **kw)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert streamed_texts(chunks[:-1]) == {0: text(full)}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert len({(c.id, c.created) for c in chunks}) == 1


def test_prefix_cache_reported_as_cached_tokens(client):
    prompt = "a long shared prefix that fills more than two blocks of sixteen tokens"
    complete(client, prompt, max_tokens=2)
    again = complete(client, prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 48


def test_echo_and_logprobs_shapes(client):
    resp = complete(client, "echo me", temperature=0, max_tokens=5, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text.startswith("echo me")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 7 + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # 2 alternatives (+ the sampled token); lone high bytes all read "\ufffd" and share a key
    assert all(2 <= len(t) <= 3 or "\ufffd" in t for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    openai_schema_validator("CreateCompletionResponse").validate(without_echo_null(resp))
    greedy = complete(client, "echo me", temperature=0, max_tokens=5, logprobs=1).choices[0]
    for token, top in zip(greedy.logprobs.tokens, greedy.logprobs.top_logprobs):
        assert max(top, key=top.get) == token  # greedy picks the best token


# ---- the cycle model: stop strings and UTF-8 -----------------------------------------------
def cycle_complete(cycle, **kw):
    return complete(cycle, "a", model="cycle", temperature=0, **kw)


def test_cycle_model_writes_known_text(cycle):
    assert text(cycle_complete(cycle, max_tokens=12)) == CYCLE
    assert text(cycle_complete(cycle, max_tokens=24)) == CYCLE * 2


@pytest.mark.parametrize(
    "stop, include, expected",
    [
        ("🎉", False, "é"),
        (["x", "世ж"], False, "é🎉"),
        ("世", True, "é🎉世"),
        ("aé", False, CYCLE[:-1]),
    ],
)
def test_stop_strings_across_tokens(cycle, stop, include, expected):
    kw = dict(max_tokens=30, stop=stop, extra_body={"include_stop_str_in_output": include})
    full = cycle_complete(cycle, **kw)
    assert text(full) == expected
    assert full.choices[0].finish_reason == "stop"
    chunks = list(cycle_complete(cycle, stream=True, **kw))
    assert streamed_texts(chunks) == {0: expected}


def test_utf8_stream_is_strict_utf8_without_replacement(cycle_server):
    body = {"model": "cycle", "prompt": "a", "max_tokens": 36, "temperature": 0, "stream": True}
    with httpx.stream("POST", cycle_server.url + "/v1/completions", json=body, timeout=60) as r:
        raw = b"".join(r.iter_bytes())
    decoded = raw.decode("utf-8", errors="strict")
    assert "\ufffd" not in decoded and "\\ufffd" not in decoded
    events = [json.loads(x[6:]) for x in decoded.split("\n\n") if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == CYCLE * 3
    assert all("\ufffd" not in e["choices"][0]["text"] for e in events)


def test_client_disconnect_aborts_every_choice(client, tiny_server):
    stream = complete(client, "long run", stream=True, n=3, max_tokens=900)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = httpx.get(tiny_server.url + "/metrics").text
        running = metric_value(metrics, "vllm:num_requests_running")
        if running == 0 and metric_value(metrics, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert running == 0
    assert metric_value(metrics, "vllm:kv_cache_usage_perc") == 0.0
