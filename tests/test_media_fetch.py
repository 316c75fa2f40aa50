"""Remote image URLs under the operator's limits (engine/multimodal/media.py) against a
loopback HTTP server: the host allow-list, the byte limit with and without a Content-Length,
one time limit for the whole fetch (a body trickled slowly, a server that never answers, a
chain of same-host redirects), and no redirect to another host."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.multimodal.media import fetch_image_bytes
from engine.multimodal.processor import ImageError

BODY = b"\x89PNG" + b"x" * 996  # 1000 bytes (the bytes are checked as an image later)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        try:
            self._answer()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first (the time limits below)

    def _answer(self):
        port = self.server.server_address[1]
        if self.path == "/ok":
            return self._send(BODY, length=True)
        if self.path == "/big":  # declares its size
            return self._send(b"x" * 5000, length=True)
        if self.path == "/big-chunked":  # no Content-Length: counted while reading
            return self._send(b"x" * 5000, length=False)
        if self.path == "/trickle":  # every read is quick, the whole body is not
            return self._send(b"x" * 40, length=True, pause=0.05)
        if self.path == "/stall":
            time.sleep(1.5)
            return self._send(BODY, length=True)
        if self.path.startswith("/hop"):  # /hop2 -> /hop1 -> /hop0 -> /ok, each hop slow
            n, _, end = self.path[4:].partition("-")  # /hop1-stall: ... -> /hop0-stall -> /stall
            time.sleep(0.3)
            tail = f"-{end}" if end else ""
            return self._redirect(f"/{end or 'ok'}" if int(n) <= 0 else f"/hop{int(n) - 1}{tail}")
        if self.path == "/elsewhere":
            return self._redirect(f"http://localhost:{port}/ok")
        self.send_error(404)

    def _send(self, body: bytes, length: bool, pause: float = 0.0):
        self.send_response(200)
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        for i in range(0, len(body), 4 if pause else len(body)):
            self.wfile.write(body[i : i + (4 if pause else len(body))])
            self.wfile.flush()
            time.sleep(pause)
        self.close_connection = not length

    def _redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def config(**kw) -> EngineConfig:
    limits = dict(allowed_media_domains=("127.0.0.1",), max_media_bytes=2000)
    return EngineConfig(device="cpu", **(limits | kw))


def refused(url: str, cfg: EngineConfig, words: str) -> None:
    with pytest.raises(ImageError, match=words) as err:
        fetch_image_bytes(url, cfg, "messages[0].content[1].image_url")
    assert err.value.param == "messages[0].content[1].image_url"


def test_allowed_host_and_the_byte_limit(host):
    assert fetch_image_bytes(host + "/ok", config(), "p") == BODY
    refused(host + "/ok", config(allowed_media_domains=None), "not allowed")
    refused(host + "/ok", config(allowed_media_domains=("localhost",)), "'127.0.0.1' is not")
    refused(host + "/big", config(), "larger than 2000 bytes")
    refused(host + "/big-chunked", config(), "larger than 2000 bytes")
    assert len(fetch_image_bytes(host + "/big", config(max_media_bytes=5000), "p")) == 5000


def test_one_time_limit_for_the_whole_fetch(host):
    fast = config(media_fetch_timeout=0.2)
    start = time.monotonic()
    refused(host + "/trickle", fast, "took too long")  # 10 reads of 0.05 s each
    refused(host + "/stall", fast, "took too long \\(more than 0.2 s\\)")
    assert time.monotonic() - start < 1.5  # neither waited for the server
    refused(host + "/hop2", config(media_fetch_timeout=0.8), "took too long")  # 3 x 0.3 s
    start = time.monotonic()  # two slow hops, then a server that never answers in time
    refused(host + "/hop1-stall", config(media_fetch_timeout=0.8), "took too long")
    assert time.monotonic() - start < 1.2  # not a fresh 0.8 s for the last hop
    assert fetch_image_bytes(host + "/hop1", config(media_fetch_timeout=3.0), "p") == BODY
    assert len(fetch_image_bytes(host + "/trickle", config(media_fetch_timeout=5.0), "p")) == 40


def test_no_redirect_to_another_host(host):
    both = config(allowed_media_domains=("127.0.0.1", "localhost"))
    refused(host + "/elsewhere", both, "redirects to another host")
    refused(host + "/hop9", config(media_fetch_timeout=10.0), "more than 3 redirects")
