"""One error object everywhere: `code` a string or null, one Retry-After, handlers in one place.

The guard (401, 413, draining 503), the loading switch (503), the app's routes (queue full,
engine dead) and the exception handlers all build their bodies with serving_errors.error_body.
"""

from __future__ import annotations

import pytest
from conftest import ScriptedEngine, build_byte_tokenizer, openai_schema_validator
from fastapi.testclient import TestClient

from engine.async_engine import EngineDeadError
from server.app import build_app
from server.lifecycle import SwitchApp
from server.metrics import Metrics
from server.middleware import GuardMiddleware, GuardSettings, ServerState
from server.openai.errors import RETRY_AFTER_S

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture()
def stack():
    scripted = ScriptedEngine(build_byte_tokenizer())
    app = build_app(scripted, Metrics("fake"))

    @app.get("/v1/boom")  # a route whose engine died after the response was chosen
    async def boom():
        raise EngineDeadError("the engine loop died")

    state = ServerState()
    guard = GuardMiddleware(app, GuardSettings(api_key=KEY, max_request_body_bytes=200), state)
    return scripted, state, TestClient(guard, raise_server_exceptions=False)


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    openai_schema_validator("ErrorResponse").validate(body)
    code = body["error"]["code"]
    assert code is None or isinstance(code, str), code  # OpenAI's schema: a string or null
    if status == 503:
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)  # one policy for every 503
    else:
        assert "retry-after" not in r.headers
    return body["error"]


def test_401_413_and_the_guards_503_have_a_string_or_null_code(stack):
    _, state, http = stack
    error = _error(http.get("/v1/models"), 401)
    assert error["type"] == "AuthenticationError" and error["code"] == "invalid_api_key"
    big = {**BODY, "prompt": "x" * 300}
    error = _error(http.post("/v1/completions", json=big, headers=AUTH), 413)
    assert error["code"] is None and "limit of 200 bytes" in error["message"]
    state.draining = True
    error = _error(http.get("/v1/models", headers=AUTH), 503)
    assert error["type"] == "ServiceUnavailableError" and error["code"] is None


def test_routes_503s_share_the_retry_after_policy(stack):
    scripted, _, http = stack
    scripted.queue_full = True
    error = _error(http.post("/v1/completions", json=BODY, headers=AUTH), 503)
    assert "queue is full" in error["message"]
    scripted.queue_full, scripted.is_alive = False, False
    _error(http.post("/v1/completions", json=BODY, headers=AUTH), 503)
    _error(http.get("/health"), 503)
    error = _error(http.get("/v1/boom", headers=AUTH), 503)  # the EngineDeadError handler
    assert error["message"] == "the engine loop died"


def test_loading_switch_answers_503_with_the_same_body_and_header():
    switch = SwitchApp()
    error = _error(TestClient(switch).get("/v1/models"), 503)
    assert error["message"] == "the model is still loading: starting" and error["code"] is None
    switch.set_stage("compiling the CPU kernels")
    error = _error(TestClient(switch).get("/health"), 503)
    assert error["message"] == "the model is still loading: compiling the CPU kernels"


def test_400s_carry_the_engines_param_and_code(stack):
    _, _, http = stack
    body = {**BODY, "prompt": "x" * 60, "max_tokens": 10}  # 70 tokens > max_model_len 64
    error = _error(http.post("/v1/completions", json=body, headers=AUTH), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x" * 60}]}
    error = _error(http.post("/v1/chat/completions", json=chat, headers=AUTH), 400)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


def test_errors_name_the_fix(stack):
    """413 names the flag, a form body is told to send JSON, an unknown model's 404 lists the
    served name (vLLM's wording first)."""
    _, _, http = stack
    big = {**BODY, "prompt": "x" * 300}
    error = _error(http.post("/v1/completions", json=big, headers=AUTH), 413)
    assert error["type"] == "RequestTooLargeError"
    assert "--max-request-body-bytes" in error["message"]
    form = http.post("/v1/completions", content=b"prompt=hi", headers={**AUTH,
                     "Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    error = _error(form, 400)
    assert error["message"].startswith("send JSON with Content-Type: application/json")
    assert "application/x-www-form-urlencoded" in error["message"]
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    error = _error(http.post("/v1/chat/completions", json=chat, headers=AUTH), 404)
    assert error["message"] == "The model `nope` does not exist. Served models: `fake`."
    assert (error["param"], error["code"]) == ("model", "model_not_found")
