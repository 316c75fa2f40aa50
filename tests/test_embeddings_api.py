"""/v1/embeddings against a real server on loopback: the official openai client (float and
base64), LangChain's OpenAIEmbeddings, every input shape, refusals naming the field, and the
generation endpoints refused on a pooling model (and embeddings on a generating one)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess
from tests.test_pooling import TEXTS, build_tiny_qwen3_embedder


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    return build_tiny_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embed-api"), seed=3)


@pytest.fixture(scope="module")
def embed_server(embed_dir):
    server = ServerProcess(
        str(embed_dir), "--dtype", "float32", "--served-model-name", "emb", "--max-model-len", "600"
    )
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def reference(embed_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embed_dir), device="cpu")
    return st.encode(TEXTS, convert_to_numpy=True)


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_openai_client_matches_sentence_transformers(embed_server, reference, fmt):
    resp = _client(embed_server).embeddings.create(model="emb", input=TEXTS, encoding_format=fmt)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    for d, ref in zip(resp.data, reference):
        got = d.embedding
        if fmt == "base64":  # asked explicitly: the client hands the string back as it came
            got = np.frombuffer(base64.b64decode(got), dtype="<f4")
        assert len(got) == 64
        assert _cos(got, ref) >= 0.9999
    num_tokens = sum(len(t.encode()) for t in TEXTS)  # the byte tokenizer: one token a byte
    assert resp.usage.prompt_tokens == num_tokens == resp.usage.total_tokens


def test_openai_client_default_is_base64_and_decodes(embed_server, reference):
    """The client asks for base64 when no format is given and decodes float32 little-endian."""
    resp = _client(embed_server).embeddings.create(model="emb", input=TEXTS[2])
    assert _cos(resp.data[0].embedding, reference[2]) >= 0.9999


def test_langchain_openai_embeddings(embed_server, reference):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model="emb",
        base_url=embed_server.url + "/v1",
        api_key="x",
        check_embedding_ctx_length=False,  # no tiktoken: send the text as is
        max_retries=0,
    )
    docs = emb.embed_documents(TEXTS)
    for got, ref in zip(docs, reference):
        assert _cos(got, ref) >= 0.9999
    assert _cos(emb.embed_query(TEXTS[1]), reference[1]) >= 0.9999


def test_token_id_inputs(embed_server, embed_dir, reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embed_dir)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    url = embed_server.url + "/v1/embeddings"
    one = httpx.post(url, json={"input": ids[0]}).json()
    assert _cos(one["data"][0]["embedding"], reference[0]) >= 0.9999
    many = httpx.post(url, json={"input": ids, "model": "emb"}).json()
    for d, ref in zip(many["data"], reference):
        assert _cos(d["embedding"], ref) >= 0.9999


def _error(resp: httpx.Response, status: int, param: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_refusals_name_the_field(embed_server):
    url = embed_server.url + "/v1/embeddings"
    assert "Matryoshka" in _error(
        httpx.post(url, json={"input": "a", "dimensions": 8}), 400, "dimensions"
    )
    long = "y" * 700  # 700 tokens > --max-model-len 600
    assert "600" in _error(httpx.post(url, json={"input": long}), 400, "input")
    _error(httpx.post(url, json={"input": []}), 400, "input")
    _error(httpx.post(url, json={"input": [[5, 10**6]]}), 400, "input")
    bad = {"input": "a", "truncate_prompt_tokens": 601}
    _error(httpx.post(url, json=bad), 400, "truncate_prompt_tokens")
    assert httpx.post(url, json={"input": "a", "model": "nope"}).status_code == 404
    ok = httpx.post(url, json={"input": long, "truncate_prompt_tokens": -1})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 600
    ok = httpx.post(url, json={"input": long, "truncate_prompt_tokens": 10})
    assert ok.json()["usage"]["prompt_tokens"] == 10
    assert httpx.get(embed_server.url + "/health").status_code == 200  # still serving


def test_truncated_equals_the_prefix(embed_server):
    url = embed_server.url + "/v1/embeddings"
    text = "abcdefghijklmnopqrstuvwxyz" * 3
    cut = httpx.post(url, json={"input": text, "truncate_prompt_tokens": 20}).json()
    pre = httpx.post(url, json={"input": text[:20]}).json()
    assert _cos(cut["data"][0]["embedding"], pre["data"][0]["embedding"]) > 0.99999


def test_base64_is_float32_little_endian(embed_server):
    url = embed_server.url + "/v1/embeddings"
    f = httpx.post(url, json={"input": "hello"}).json()["data"][0]["embedding"]
    b = httpx.post(url, json={"input": "hello", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, np.asarray(f, dtype=np.float32), atol=0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_generation_refused_on_pooling_model(embed_server, path):
    body = {"model": "emb", "prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    assert "pooling model" in _error(httpx.post(embed_server.url + path, json=body), 400, "model")


def test_embeddings_refused_on_generating_model(tiny_server):
    resp = httpx.post(tiny_server.url + "/v1/embeddings", json={"input": "a", "model": "tiny"})
    assert "pooling model" in _error(resp, 400, "model")


def test_concurrent_requests_share_batches(embed_server, reference):
    from concurrent.futures import ThreadPoolExecutor

    url = embed_server.url + "/v1/embeddings"
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: httpx.post(url, json={"input": TEXTS[i % 4]}), range(16)))
    for i, r in enumerate(outs):
        assert _cos(r.json()["data"][0]["embedding"], reference[i % 4]) >= 0.9999


@pytest.mark.slow
def test_minilm_server_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    from engine.model_loader.loader import resolve_model

    server = ServerProcess("all-MiniLM-L6-v2", "--dtype", "float32").wait_ready()
    try:
        texts = [*TEXTS, "word " * 400]  # truncated like ST only when asked: 256 is the limit
        resp = _client(server).embeddings.create(
            model="all-MiniLM-L6-v2", input=texts, extra_body={"truncate_prompt_tokens": -1}
        )
        st = SentenceTransformer(str(resolve_model("all-MiniLM-L6-v2")), device="cpu")
        ref = st.encode(texts, convert_to_numpy=True)
        for d, r in zip(resp.data, ref):
            assert len(d.embedding) == 384 and _cos(d.embedding, r) >= 0.9999
        assert resp.usage.prompt_tokens == sum(
            len(st.tokenizer(t, truncation=True, max_length=256)["input_ids"]) for t in texts
        )
    finally:
        server.stop()


def test_metrics_count_embedding_requests(embed_server):
    from tests.conftest import metric_value

    def read(name, **labels):
        text = httpx.get(embed_server.url + "/metrics").text
        return metric_value(text, name, {"model_name": "emb", **labels})

    before = read("vllm:request_success_total", finished_reason="stop")
    tokens = read("vllm:prompt_tokens_total")
    httpx.post(embed_server.url + "/v1/embeddings", json={"input": ["abc", "de"]})
    # a causal embedder runs each input as its own engine request, as vLLM does
    assert read("vllm:request_success_total", finished_reason="stop") == before + 2
    assert read("vllm:prompt_tokens_total") == tokens + 5
    assert read("vllm:e2e_request_latency_seconds_count") >= 1


def test_causal_embedder_runs_on_the_scheduler(embed_server, reference):
    """The decoder embedder is served by the shared scheduler: a repeated long input hits the
    prefix cache (last-token pooling), chunked under the server's --max-num-batched-tokens."""
    from tests.conftest import metric_value

    def read(name):
        text = httpx.get(embed_server.url + "/metrics").text
        return metric_value(text, name, {"model_name": "emb"})

    hits = read("vllm:prefix_cache_hits_total")
    for _ in range(2):
        resp = httpx.post(embed_server.url + "/v1/embeddings", json={"input": TEXTS[1]})
        assert _cos(resp.json()["data"][0]["embedding"], reference[1]) >= 0.9999
    assert read("vllm:prefix_cache_hits_total") >= hits + 512
    assert read("vllm:kv_cache_usage_perc") == 0.0  # every block given back (cached ones free)
