"""/v1/score and /v1/rerank against a real server: a tiny random BERT cross-encoder scores as
sentence-transformers' CrossEncoder does (sigmoid of the logit, pairs with token types), an
embedding model scores by cosine similarity; Cohere/Jina's rerank shape, top_n, refusals."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.model_loader.loader import resolve_model
from engine.pooling_engine import PoolingEngine
from tests.conftest import ServerProcess
from tests.test_pooling import build_tiny_qwen3_embedder

QUERY = "what does a paged KV cache do?"
DOCS = [
    "It keeps keys and values in fixed-size blocks.",
    "Paris is the capital of France.",
    "Blocks are shared between requests with a common prefix, so memory is saved.",
    "cats",
]


def build_tiny_cross_encoder(path: Path, seed: int = 0) -> Path:
    """A random-weight BertForSequenceClassification (one label) with MiniLM's WordPiece
    tokenizer, as a cross-encoder reranker checkpoint is saved."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
        initializer_range=0.2,
    )
    BertForSequenceClassification(cfg).float().eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-ce"))


@pytest.fixture(scope="module")
def ce_reference(ce_dir):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(ce_dir), device="cpu").predict([(QUERY, d) for d in DOCS])


@pytest.fixture(scope="module")
def ce_server(ce_dir):
    server = ServerProcess(str(ce_dir), "--dtype", "float32", "--served-model-name", "ce")
    yield server.wait_ready()
    server.stop()


def test_engine_scores_equal_cross_encoder(ce_dir, ce_reference):
    engine = PoolingEngine(EngineConfig(model=str(ce_dir), dtype="float32"))
    assert engine.is_cross_encoder
    enc = [engine.tokenizer(QUERY, d) for d in DOCS]
    scores = engine.score([e["input_ids"] for e in enc], [e["token_type_ids"] for e in enc])
    assert np.allclose(scores, ce_reference, atol=1e-5)
    assert np.ptp(ce_reference) > 1e-3  # the documents do score differently


def test_score_api(ce_server, ce_reference):
    body = {"model": "ce", "text_1": QUERY, "text_2": DOCS}
    resp = httpx.post(ce_server.url + "/v1/score", json=body).json()
    assert [d["index"] for d in resp["data"]] == list(range(len(DOCS)))
    assert np.allclose([d["score"] for d in resp["data"]], ce_reference, atol=1e-5)
    assert resp["usage"]["prompt_tokens"] > 0
    pairwise = {"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}
    two = httpx.post(ce_server.url + "/score", json=pairwise).json()
    assert np.allclose([d["score"] for d in two["data"]], ce_reference[:2], atol=1e-5)
    bad = httpx.post(ce_server.url + "/v1/score", json={"text_1": ["a", "b"], "text_2": DOCS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_api(ce_server, ce_reference, path):
    body = {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 3}
    resp = httpx.post(ce_server.url + path, json=body).json()
    order = list(np.argsort(-ce_reference))[:3]
    assert [r["index"] for r in resp["results"]] == order
    for r in resp["results"]:
        assert r["document"]["text"] == DOCS[r["index"]]
        assert abs(r["relevance_score"] - ce_reference[r["index"]]) < 1e-5
    assert resp["usage"]["total_tokens"] > 0


def test_cross_encoder_refuses_embeddings(ce_server):
    resp = httpx.post(ce_server.url + "/v1/embeddings", json={"input": "a"})
    assert resp.status_code == 400 and "cross-encoder" in resp.json()["error"]["message"]


def test_embedding_model_scores_by_cosine(tmp_path):
    """/v1/score on an embedding model: cosine of sentence-transformers' embeddings."""
    from sentence_transformers import SentenceTransformer

    model_dir = build_tiny_qwen3_embedder(tmp_path / "e", seed=5)
    ref = SentenceTransformer(str(model_dir), device="cpu").encode([QUERY, *DOCS])
    want = [float(ref[0] @ r / np.linalg.norm(ref[0]) / np.linalg.norm(r)) for r in ref[1:]]
    server = ServerProcess(str(model_dir), "--dtype", "float32").wait_ready()
    try:
        body = {"query": QUERY, "documents": [{"text": d} for d in DOCS]}
        resp = httpx.post(server.url + "/v1/rerank", json=body).json()
        got = {r["index"]: r["relevance_score"] for r in resp["results"]}
        assert np.allclose([got[i] for i in range(len(DOCS))], want, atol=1e-4)
    finally:
        server.stop()


def _qwen3_reranker_dir(path: Path) -> Path:
    """A tiny random Qwen3ForCausalLM: Qwen3-Reranker is a generating checkpoint scored by its
    LM head's "yes" and "no" rows ("y" and "n": single tokens of the byte tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import build_byte_tokenizer, tiny_config

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(7)
    cfg = Qwen3Config(**tiny_config(tokenizer, head_dim=16))
    Qwen3ForCausalLM(cfg).float().eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["n", "y"],
    "is_original_qwen3_reranker": True,
}


def test_qwen3_reranker_yes_no_scores(tmp_path):
    """sigmoid(logit_yes - logit_no) at the pair's last token (= softmax([no, yes])[yes], the
    model card's score), equal to transformers' on the same weights; alone and batched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = _qwen3_reranker_dir(tmp_path / "rr")
    engine = PoolingEngine(EngineConfig(model=str(model_dir), dtype="float32"), RERANKER_OVERRIDES)
    assert engine.is_cross_encoder
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["n", "y"])
    prompts = [tok(QUERY + "\n" + d)["input_ids"] for d in DOCS]
    want = []
    for p in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0, -1]
        want.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    got = engine.score(prompts, [[0] * len(p) for p in prompts])
    assert np.allclose(got, want, atol=1e-5) and np.ptp(want) > 1e-4
    assert np.allclose([engine.score([p], [[0] * len(p)])[0] for p in prompts], want, atol=1e-5)


def test_qwen3_reranker_served_with_hf_overrides(tmp_path):
    import json

    model_dir = _qwen3_reranker_dir(tmp_path / "rr")
    engine = PoolingEngine(EngineConfig(model=str(model_dir), dtype="float32"), RERANKER_OVERRIDES)
    want = engine.score(
        [engine.tokenizer(QUERY, d)["input_ids"] for d in DOCS],
        [[0]] * len(DOCS),
    )
    args = ("--dtype", "float32", "--hf-overrides", json.dumps(RERANKER_OVERRIDES))
    server = ServerProcess(str(model_dir), *args).wait_ready()
    try:
        resp = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
        got = {r["index"]: r["relevance_score"] for r in resp.json()["results"]}
        assert np.allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
        assert chat.status_code == 400
    finally:
        server.stop()
