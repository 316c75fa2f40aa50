"""API-key auth matrix over raw loopback HTTP (no client-side path cleanup), plus the timeout."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from conftest import ServerProcess, wait_idle

from server.auth import bearer_token, is_authorized, is_public

KEY = "s3cret-key"

PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/render"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/models/"),
    ("POST", "/v1/completions/"),
    ("GET", "/V1/models"),
    ("GET", "/v1/MODELS"),
    ("GET", "//v1/models"),
    ("GET", "/v1//models"),
    ("GET", "/v1/./models"),
    ("GET", "/v1/../v1/models"),
    ("GET", "/health/../v1/models"),
    ("GET", "/health/%2e%2e/v1/models"),
    ("GET", "/v1%2Fmodels"),
    ("GET", "/v1/models?api_key=" + KEY),
    ("GET", "/v1/models#"),
    ("GET", "/HEALTH"),
    ("GET", "/metrics/"),
    ("GET", "/nope"),
    ("OPTIONS", "/v1/completions"),
    ("OPTIONS", "/v1/models/"),
    ("OPTIONS", "*"),
    ("HEAD", "/v1/models"),
    ("PUT", "/v1/completions"),
    ("DELETE", "/v1/models"),
]

BAD_HEADERS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Token {KEY}"},
    {"X-API-Key": KEY},
    {"Api-Key": KEY},
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    env = {"PAGEDSERVE_API_KEY": KEY, "PAGEDSERVE_FAULT_INJECT": "step_delay_ms:25"}
    s = ServerProcess(
        str(tiny_model_dir), "--dtype", "float32", "--request-timeout", "2", env=env
    ).wait_ready()
    yield s
    s.stop()


def _raw(server: ServerProcess, method: str, path: str, headers: dict | None = None, body=None):
    """http.client sends the path byte for byte: no normalisation on our side."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_public_policy_and_bearer_parsing():
    assert is_public("/health", False) and is_public("/metrics", False)
    assert not is_public("/metrics", True) and not is_public("/health/", False)
    assert not is_public("/v1/models", False) and not is_public("/HEALTH", False)
    assert bearer_token([(b"authorization", b"bEaReR  tok ")]) == "tok"
    assert bearer_token([(b"authorization", b"Basic tok")]) is None
    assert is_authorized([(b"Authorization", b"Bearer k\xc3\xa9")], "k\u00c3\u00a9")
    assert not is_authorized([(b"authorization", b"Bearer k")], "kk")


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_protected_without_key_is_401(server, method, path):
    body = {"prompt": "x", "max_tokens": 1} if method in ("POST", "PUT") else None
    status, headers, raw = _raw(server, method, path, body=body)
    assert status == 401, (method, path, status, raw[:200])
    assert headers.get("www-authenticate") == "Bearer"
    if method != "HEAD":
        error = json.loads(raw)["error"]
        # OpenAI's schema: code is a string or null (OpenAI's own code for a bad key).
        assert error["type"] == "AuthenticationError" and error["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", BAD_HEADERS)
def test_wrong_credentials_are_401(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
        body = {"prompt": "x", "max_tokens": 1} if method == "POST" else None
        status, _, raw = _raw(server, method, path, headers, body)
        assert status == 401, (headers, path, raw[:200])


def test_right_key_is_served_and_public_routes_need_none(server):
    good = {"Authorization": f"Bearer {KEY}"}
    assert _raw(server, "GET", "/v1/models", good)[0] == 200
    assert _raw(server, "GET", "/v1/models", {"Authorization": f"bearer {KEY}"})[0] == 200
    body = {"prompt": "hi", "max_tokens": 2}
    status, _, raw = _raw(server, "POST", "/v1/completions", good, body)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    assert _raw(server, "GET", "/health")[0] == 200
    assert _raw(server, "GET", "/ping")[0] == 200  # public like /health, GET and POST
    assert _raw(server, "POST", "/ping")[0] == 200
    # Probes written with a slash answer like the plain paths (vLLM's are public the same way).
    assert _raw(server, "GET", "/health/")[0] == 200 and _raw(server, "POST", "/ping/")[0] == 200
    assert _raw(server, "GET", "/version")[0] == 200
    status, _, raw = _raw(server, "GET", "/metrics")  # public by policy (--protect-metrics)
    assert status == 200 and b"pagedserve:kv_cache_free_blocks" in raw


def test_request_timeout_aborts_with_an_error(server):
    good = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "slow", "max_tokens": 500, "ignore_eos": True}
    status, _, raw = _raw(server, "POST", "/v1/completions", good, body)
    assert status == 408 and "timeout" in json.loads(raw)["error"]["message"]
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=good, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "TimeoutError" and error["code"] is None  # a string or null
    assert json.loads(events[0])["choices"][0]["finish_reason"] is None  # it had started
    wait_idle(server.url)  # the aborted requests freed their blocks
