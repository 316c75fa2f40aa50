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
        echoed = http.post("/v1/chat/completions/render", json=chat).json()
        assert echoed["cache_salt"] == "tenant-b"
        bad = http.post("/v1/chat/completions/render", json={**chat, "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_offline_dict_prompts_carry_the_salt_and_forks_keep_it(tiny_model_dir):
    """LLM.generate takes vLLM's {"prompt_token_ids", "cache_salt"} prompts; n > 1 under a salt
    still forks the samples from the first (a parent with the same salt)."""
    from test_forks import _assert_all_free

    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = list(range(40, 70))

    def cached(salt: str | None) -> int:
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids,
                                                                  "cache_salt": salt}
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        return out.num_cached_tokens

    assert [cached("a"), cached("a"), cached("b"), cached(None), cached("b")] == [0, 28, 0, 0, 28]
    sched = llm.engine.scheduler
    forks = sched.num_forks_total
    n3 = SamplingParams(n=3, temperature=0.0, max_tokens=2, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids, "cache_salt": "c"}, n3, use_tqdm=False)
    assert len(out.outputs) == 3 and sched.num_forks_total == forks + 2  # two forks of the first
    _assert_all_free(llm)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": ""}, params, use_tqdm=False)


def test_a_sample_forks_only_from_a_parent_with_its_salt_and_adapter():
    from conftest import make_request, make_scheduler

    from engine.core.forks import hold_for_fork
    from engine.lora.request import LoRARequest

    sched = make_scheduler()
    parent = make_request("p", 9)
    parent.cache_salt = "a"
    sched.add_request(parent)
    for i, (salt, lora) in enumerate([("a", None), ("b", None), (None, None),
                                      ("a", LoRARequest("sql", 1, "/sql", "ab" * 32))]):
        child = make_request(f"c{i}", 9)
        child.fork_parent_id, child.cache_salt, child.lora_request = "p", salt, lora
        assert hold_for_fork(sched, child) is (i == 0), (salt, lora)
