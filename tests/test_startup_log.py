"""The start-up log says each decision once (model and architecture, dtype, max_model_len and
why, the KV cache in bytes, blocks and tokens, attention backend, kernels, quantization,
executor), and our own use of transformers prints none of its warnings."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, resolve_config


def test_max_model_len_defaults_to_the_models_own_limit():
    """No silent cap: Gemma 3 270M declares 32,768 positions and serves 32,768."""
    hf = SimpleNamespace(max_position_embeddings=32768)
    assert resolve_config(EngineConfig(), hf).max_model_len == 32768
    assert resolve_config(EngineConfig(max_model_len=4096), hf).max_model_len == 4096


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_ready_line_names_every_decision_once(tiny_model_dir, caplog):
    # transformers' own root logger does not propagate to pytest's: collect it directly
    library = _Collect()
    logging.getLogger("transformers").addHandler(library)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert len(ready) == 1
    line = ready[0]
    kv_bytes = engine.executor.kv_cache_bytes
    tokens = engine.executor.num_blocks * engine.config.block_size
    assert "(LlamaForCausalLM)" in line and "dtype float32 on cpu" in line
    assert "max_model_len 1024 (the model's own limit; --max-model-len lowers it)" in line
    assert f"({kv_bytes:,} bytes), {engine.executor.num_blocks:,} blocks" in line
    assert f"= {tokens:,} tokens" in line
    assert "attention backend torch" in line and "kernels: " in line
    assert "quantization none" in line and "executor uni x 1" in line
    every = " ".join(r.getMessage() for r in caplog.records)
    assert every.count("attention backend") == 1
    # an over-long text through both tokenizers (the engine's and the server's copy)
    server_copy = AsyncEngine(engine, lambda _: None, None).tokenizer
    for tokenizer in (engine.tokenizer, server_copy):
        tokenizer.model_max_length = 8
        tokenizer("x" * 64)
    logging.getLogger("transformers").removeHandler(library)
    said = " ".join(library.messages)
    assert "torch_dtype" not in said and "Token indices sequence length" not in said, said
