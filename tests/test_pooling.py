"""Pooling runner and engine: embeddings equal sentence-transformers' (cosine >= 0.9999, float32)
for the real all-MiniLM-L6-v2 (mean + Normalize, BERT encoder) and a tiny random Qwen3 embedder
(last token + Normalize, decoder over the paged KV path), alone and batched with very different
lengths; pooling config read from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.model_loader.loader import resolve_model
from engine.pooling_engine import PoolingEngine
from engine.runner.pooling_config import is_pooling_checkpoint, read_pooling_config
from tests.conftest import build_byte_tokenizer, tiny_config

TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "x",
]


def build_tiny_qwen3_embedder(path: Path, pooling: str = "lasttoken", seed: int = 0) -> Path:
    """A random-weight Qwen3Model saved as sentence-transformers saves Qwen3-Embedding."""
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(**tiny_config(tokenizer, head_dim=16, architectures=["Qwen3Model"]))
    Qwen3Model(cfg).float().eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (p, kind) in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pool = {"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    return path


@pytest.fixture(scope="session")
def qwen3_embed_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3_embedder(tmp_path_factory.mktemp("tiny-qwen3-embed"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return resolve_model("all-MiniLM-L6-v2")


def _engine(model_dir: Path, **kw) -> PoolingEngine:
    return PoolingEngine(EngineConfig(model=str(model_dir), dtype="float32", **kw))


def _st_reference(model_dir: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    return st.encode(texts, convert_to_tensor=True, batch_size=len(texts))


def _assert_close(ours: list[torch.Tensor], ref: torch.Tensor) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, i
        cos = torch.nn.functional.cosine_similarity(a, b.float(), dim=0).item()
        assert cos >= 0.9999, (i, cos)
        assert abs(a.norm().item() - b.norm().item()) < 1e-4, i  # normalised as the model says


def _ids(engine: PoolingEngine, texts: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok(t, truncation=True, max_length=engine.max_model_len)["input_ids"] for t in texts]


@pytest.mark.parametrize("budget", [16384, 40])  # one batch; many batches (each prompt alone)
def test_qwen3_embedder_matches_sentence_transformers(qwen3_embed_dir, budget):
    engine = _engine(qwen3_embed_dir, max_num_batched_tokens=budget)
    assert engine.pooling.pooling_type == "LAST" and engine.pooling.normalize
    ids = _ids(engine, TEXTS)
    ref = _st_reference(qwen3_embed_dir, TEXTS)
    _assert_close(engine.embed(ids), ref)
    _assert_close([engine.embed([p])[0] for p in ids], ref)  # alone == batched


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm_dir):
    engine = _engine(minilm_dir, max_num_batched_tokens=64)
    assert engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    assert engine.pooling.pooling_type == "MEAN" and engine.pooling.normalize
    texts = [*TEXTS, "word " * 400]  # the last is truncated to 256 tokens as ST does
    ids = _ids(engine, texts)
    assert len(ids[-1]) == 256
    ref = _st_reference(minilm_dir, texts)
    _assert_close(engine.embed(ids), ref)
    _assert_close([engine.embed([ids[1]])[0]], ref[1:2])


def test_pooling_config_from_checkpoint(tmp_path, qwen3_embed_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(qwen3_embed_dir)
    assert is_pooling_checkpoint(qwen3_embed_dir, cfg)
    mean_dir = build_tiny_qwen3_embedder(tmp_path / "mean", pooling="mean_tokens")
    assert read_pooling_config(mean_dir, cfg).pooling_type == "MEAN"
    (mean_dir / "modules.json").write_text(
        json.dumps([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}])
    )
    with pytest.raises(ValueError, match="Dense"):
        read_pooling_config(mean_dir, cfg)


def test_mean_pooling_decoder_matches_sentence_transformers(tmp_path):
    model_dir = build_tiny_qwen3_embedder(tmp_path / "m", pooling="mean_tokens", seed=1)
    engine = _engine(model_dir)
    _assert_close(engine.embed(_ids(engine, TEXTS)), _st_reference(model_dir, TEXTS))


def test_dimensions_truncate_then_normalize(qwen3_embed_dir):
    engine = _engine(qwen3_embed_dir)
    ids = _ids(engine, TEXTS[:2])
    full = engine.embed(ids)
    short = engine.embed(ids, dimensions=16)
    for f, s in zip(full, short):
        assert s.shape == (16,)
        assert abs(s.norm().item() - 1.0) < 1e-5
        assert torch.allclose(s, torch.nn.functional.normalize(f[:16], dim=0), atol=1e-6)


def test_runner_choice(tiny_model_dir, qwen3_embed_dir, minilm_dir):
    from engine.pooling_engine import wants_pooling

    assert not wants_pooling(str(tiny_model_dir))  # a LlamaForCausalLM folder generates
    assert wants_pooling(str(tiny_model_dir), task="embed")
    assert wants_pooling(str(tiny_model_dir), runner="pooling")
    assert wants_pooling(str(qwen3_embed_dir))  # modules.json
    assert not wants_pooling(str(qwen3_embed_dir), runner="generate")
    assert wants_pooling("all-MiniLM-L6-v2")  # BertModel
    assert minilm_dir.is_dir()


def test_causal_folder_served_as_embedder_pools_last_token(tiny_model_dir):
    """--runner pooling on a generating checkpoint (no modules.json): last token, normalised,
    equal to transformers' final hidden state of the last token."""
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_dir)
    assert (engine.pooling.pooling_type, engine.pooling.normalize) == ("LAST", True)
    ids = _ids(engine, TEXTS[:3])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for got, p in zip(engine.embed(ids), ids):
        with torch.no_grad():
            last = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
        want = torch.nn.functional.normalize(last, dim=0)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() >= 0.9999


def test_pooling_refuses_tensor_parallel_and_quantization(qwen3_embed_dir):
    with pytest.raises(ValueError, match="tensor-parallel"):
        _engine(qwen3_embed_dir, quantization="int8")
