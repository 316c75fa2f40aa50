"""Multi-LoRA through the server: the official openai client picks adapters by `model`."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import ServerProcess, build_byte_tokenizer
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
    assert cards["attn"].parent == "tiny" and cards["mlp"].parent == "tiny-base"
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
        adapter = lora_server.paths.get(model)
        (expected,) = peft_greedy(tiny_model_dir, adapter, [ids], MAX_NEW)
        assert out.usage.completion_tokens == MAX_NEW
        assert texts[model] == tok.decode(expected), model
    assert len(set(texts.values())) == 3
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)
