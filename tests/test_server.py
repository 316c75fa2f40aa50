"""The server end to end on loopback, driven by the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import ScriptedEngine, build_byte_tokenizer, metric_value, run_engine


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_has_text_usage_and_finish_reason(client):
    resp = client.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert choice.finish_reason == "length" and choice.text
    assert resp.usage.prompt_tokens == len(b"Hello there")  # byte tokenizer
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7


def test_stream_text_equals_non_streamed_greedy_text(client):
    kw = dict(
        model="tiny",
        prompt="The capital of France is",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full
    assert len({c.id for c in chunks}) == 1
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_stream_ends_with_done(tiny_server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_models_lists_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_too_long_prompt_is_400_with_error_object(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 1000, max_tokens=100)
    assert "maximum context length is 1024 tokens" in e.value.body["message"]
    assert e.value.status_code == 400
    # The server keeps serving.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_metrics_after_traffic(client, tiny_server):
    client.completions.create(model="tiny", prompt="count me", max_tokens=4, temperature=0)
    text = httpx.get(tiny_server.url + "/metrics").text
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "vllm:num_requests_waiting") == 0
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric_value(text, "vllm:num_preemptions_total") == 0
    assert metric_value(text, "vllm:generation_tokens_total") >= 4
    assert (
        metric_value(text, "vllm:request_success_total", {"finished_reason": "length"}) >= 1
    )


def test_health(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_ping_answers_like_health_200_then_503(path):
    """vLLM has both, GET and POST; 503 with the same error object once the engine is gone."""
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.metrics import Metrics

    scripted = ScriptedEngine(build_byte_tokenizer())
    http = TestClient(build_app(scripted, Metrics("fake")))
    assert [http.get(path).status_code, http.post(path).status_code] == [200, 200]
    scripted.is_alive = False
    dead = [http.get(path), http.post(path)]
    assert [r.status_code for r in dead] == [503, 503]
    assert all(r.json() == http.get("/health").json() for r in dead)
    assert dead[0].json()["error"]["type"] == "ServiceUnavailableError"


def test_each_request_is_validated_once(tiny_model_dir, monkeypatch):
    """One engine Request per choice, checked once (server and offline API alike)."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core.scheduler import Scheduler
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from server.app import build_app
    from server.metrics import Metrics

    checks, queue_checks = [], []
    check_fits, check_queue = Scheduler.check_fits, AsyncEngine.check_queue

    def fits_spy(self, request):
        checks.append(request.request_id)
        return check_fits(self, request)

    def queue_spy(self, num_new=1):
        queue_checks.append(num_new)
        return check_queue(self, num_new)

    monkeypatch.setattr(Scheduler, "check_fits", fits_spy)
    monkeypatch.setattr(AsyncEngine, "check_queue", queue_spy)
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=128)
    engine = LLMEngine(cfg)
    async_engine = AsyncEngine(engine, max_num_queued_reqs=64)
    async_engine.start()
    try:
        http = TestClient(build_app(async_engine, Metrics("tiny")))
        body = {"prompt": "hi", "max_tokens": 2, "n": 2, "stream": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert len(checks) == len(set(checks)) == 2 and queue_checks == [2]
        checks.clear()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert len(checks) == 1
        checks.clear()
        r = http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert len(checks) == 1 and queue_checks == [2, 1]  # refused before the queue bound
    finally:
        async_engine.shutdown()
    checks.clear()
    run_engine(engine, {"offline": ([5, 6, 7], SamplingParams(max_tokens=2))})
    assert checks == ["offline"]


def test_reused_x_request_id_serves_both_requests(tiny_server):
    """A client-chosen id names the response, but never collides inside the engine."""
    import concurrent.futures

    body = {"model": "tiny", "prompt": "same id", "max_tokens": 8, "ignore_eos": True}
    headers = {"X-Request-Id": "client-chosen-id"}

    def call():
        return httpx.post(
            tiny_server.url + "/v1/completions", json=body, headers=headers, timeout=120
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: call(), range(2)))
    assert [r.status_code for r in responses] == [200, 200]
    assert {r.json()["id"] for r in responses} == {"cmpl-client-chosen-id"}
    assert all(r.headers["x-request-id"] == "client-chosen-id" for r in responses)
    assert httpx.get(tiny_server.url + "/health").status_code == 200
