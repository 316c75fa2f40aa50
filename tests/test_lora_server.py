"""Multi-LoRA through the server: the official openai client picks adapters by `model`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import ServerProcess, build_byte_tokenizer, wait_idle
from test_lora import ATTN, MLP, build_adapter, peft_greedy

MAX_NEW = 8


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    attn = build_adapter(tiny_model_dir, root / "attn", 11, 8, ATTN, lora_alpha=16)
    mlp = build_adapter(tiny_model_dir, root / "mlp", 12, 4, MLP, lora_alpha=8)
    as_json = json.dumps({"name": "mlp", "path": str(mlp), "base_model_name": "tiny-base"})
    server = ServerProcess(
        str(tiny_model_dir),
        "--dtype", "float32", "--served-model-name", "tiny",
        "--enable-lora", "--lora-modules", f"attn={attn}", as_json, "--max-loras", "2",
    )  # fmt: skip
    server.paths = {"attn": attn, "mlp": mlp}
    yield server.wait_ready()
    server.stop()


def test_models_list_adapters_with_parent(lora_server):
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "attn", "mlp"]
    # vLLM 0.32's `vllm serve` lists a base_model_name that is not a served model's name (here
    # "tiny-base") as the served model: a parent is always a model this server serves
    assert cards["attn"].parent == "tiny" and cards["mlp"].parent == "tiny"
    assert cards["attn"].root == str(lora_server.paths["attn"])
    assert client.models.retrieve("mlp").id == "mlp"


def test_completions_pick_the_adapter_by_model(lora_server, tiny_model_dir):
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    tok = build_byte_tokenizer()
    prompt = "Hello adapters"
    ids = tok(prompt)["input_ids"]
    texts = {}
    for model in ("tiny", "attn", "mlp"):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts[model] = out.choices[0].text
        assert out.model == model
        adapter = lora_server.paths.get(model)
        (expected,) = peft_greedy(tiny_model_dir, adapter, [ids], MAX_NEW)
        assert out.usage.completion_tokens == MAX_NEW
        assert texts[model] == tok.decode(expected), model
    assert len(set(texts.values())) == 3
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)


def test_runtime_updates_need_the_opt_in(lora_server):
    r = httpx.post(
        lora_server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}
    )
    assert r.status_code == 404


@pytest.fixture(scope="module")
def dynamic_server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic-loras")
    server = ServerProcess(
        str(tiny_model_dir),
        "--dtype", "float32", "--served-model-name", "tiny", "--api-key", "sekret",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip
    server.root = root
    yield server.wait_ready()
    server.stop()


def test_load_and_unload_adapters_at_runtime(dynamic_server, tiny_model_dir):
    url, root = dynamic_server.url, dynamic_server.root
    auth = {"Authorization": "Bearer sekret"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    a = build_adapter(tiny_model_dir, root / "a", 21, 8, ATTN, lora_alpha=16)
    b = build_adapter(tiny_model_dir, root / "b", 22, 4, MLP, lora_alpha=8)
    big = build_adapter(tiny_model_dir, root / "big", 23, 16, ATTN)
    tok = build_byte_tokenizer()
    prompt = "runtime adapters"
    ids = tok(prompt)["input_ids"]

    def complete(model: str) -> str:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    def load(name, path, **kw):
        body = {"lora_name": name, "lora_path": str(path), **kw}
        return httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth)

    assert httpx.post(url + "/v1/load_lora_adapter", json={}).status_code == 401  # the API key
    r = load("live", a)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'live' added successfully."
    assert [m.id for m in client.models.list().data] == ["tiny", "live"]
    expected_a = tok.decode(peft_greedy(tiny_model_dir, a, [ids], MAX_NEW)[0])
    assert complete("live") == expected_a
    r = load("live", b)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert "load_inplace" in r.json()["error"]["message"]
    r = load("x", root / "nope")  # no such folder: 404, as vLLM
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    assert r.json()["error"]["message"] == f"{root / 'nope'}: no such LoRA adapter folder"
    r = load("live", big, load_inplace=True)  # r=16 > --max-lora-rank 8: refused, "live" stays
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "big/adapter_config.json: r=16 exceeds --max-lora-rank 8" in r.json()["error"]["message"]
    assert complete("live") == expected_a
    assert load("live", b, load_inplace=True).status_code == 200  # new weights, same name
    assert complete("live") == tok.decode(peft_greedy(tiny_model_dir, b, [ids], MAX_NEW)[0])
    body = {"lora_name": "live"}
    r = httpx.post(url + "/v1/unload_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'live' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete("live")
    r = httpx.post(url + "/v1/unload_lora_adapter", json=body, headers=auth)
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    assert complete("tiny") == tok.decode(peft_greedy(tiny_model_dir, None, [ids], MAX_NEW)[0])


def test_lora_requests_info_gauge(lora_server):
    from conftest import metric_value

    from server.metrics import V  # vLLM's "vllm:" prefix

    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="attn", prompt="hi", max_tokens=900, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    text = httpx.get(lora_server.url + "/metrics").text
    stream.close()
    running = {"max_lora": "2", "running_lora_adapters": "attn", "waiting_lora_adapters": ""}
    assert metric_value(text, V + "lora_requests_info", running) > 1e9  # a Unix time


def test_chat_picks_the_adapter_by_model(lora_server, tiny_model_dir):
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    tok = build_byte_tokenizer()
    messages = [{"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    out = client.chat.completions.create(
        model="mlp", messages=messages, max_tokens=MAX_NEW, temperature=0.0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )  # fmt: skip
    (expected,) = peft_greedy(tiny_model_dir, lora_server.paths["mlp"], [ids], MAX_NEW)
    assert out.model == "mlp"
    assert out.choices[0].message.content == tok.decode(expected)


def test_evicted_adapter_whose_folder_is_gone_is_refused_and_the_server_serves_on(
    tiny_model_dir, tmp_path
):
    """--max-cpu-loras 1 keeps only the last adapter loaded: the first, evicted, has its folder
    deleted; a request for it gets a 400 naming the adapter, the missing folder and the fix,
    before any step, and the server goes on serving the others with no KV block held."""
    import shutil

    gone = build_adapter(tiny_model_dir, tmp_path / "gone", 31, 8, ATTN, lora_alpha=16)
    mlp = build_adapter(tiny_model_dir, tmp_path / "mlp", 32, 4, MLP, lora_alpha=8)
    server = ServerProcess(
        str(tiny_model_dir),
        "--dtype", "float32", "--served-model-name", "tiny", "--enable-lora",
        "--lora-modules", f"gone={gone}", f"mlp={mlp}", "--max-loras", "1", "--max-cpu-loras", "1",
    )  # fmt: skip
    try:
        url = server.wait_ready().url
        shutil.rmtree(gone)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        tok = build_byte_tokenizer()
        ids = tok("evicted adapters")["input_ids"]

        def complete(model: str, stream: bool = False):
            return client.completions.create(
                model=model, prompt="evicted adapters", max_tokens=MAX_NEW, temperature=0.0,
                stream=stream, extra_body={"ignore_eos": True},
            )  # fmt: skip

        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                complete("gone", stream)
            err = e.value.body
            assert (
                err["param"] == "model" and "LoRA adapter `gone` cannot be served" in err["message"]
            )
            assert f"{gone}: no such LoRA adapter folder" in err["message"]
            assert "evicted from memory (--max-cpu-loras 1)" in err["message"]
            assert "/v1/load_lora_adapter" in err["message"]
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "gone", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert (
            chat.status_code == 400 and "`gone` cannot be served" in chat.json()["error"]["message"]
        )
        expected = tok.decode(
            peft_greedy(tiny_model_dir, mlp, [ids], MAX_NEW)[0], skip_special_tokens=True
        )
        assert complete("mlp").choices[0].text == expected
        expected = tok.decode(
            peft_greedy(tiny_model_dir, None, [ids], MAX_NEW)[0], skip_special_tokens=True
        )
        assert complete("tiny").choices[0].text == expected
        wait_idle(url)  # nothing running or waiting, every KV block free
    finally:
        server.stop()
