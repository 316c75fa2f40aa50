"""An image URL's bytes under the operator's rules (blocking: the server runs it in a thread).

- `data:` URLs: base64 only, size-checked before decoding.
- http(s): only hosts in allowed_media_domains (exact host names, vLLM's
  --allowed-media-domains; none allowed when unset), at most max_media_bytes, within
  media_fetch_timeout seconds in all, redirects followed only to the same host (and at most 3).
- file: only under allowed_local_media_path (vLLM's --allowed-local-media-path).
Every refusal is an ImageError naming the request's part (`param`).
"""

from __future__ import annotations

import base64
import binascii
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from engine.multimodal.processor import ImageError

_MAX_REDIRECTS = 3


def fetch_image_bytes(url: str, config, param: str) -> bytes:
    """The encoded image behind `url` (config: EngineConfig's media fields)."""
    if url.startswith("data:"):
        return _data_url(url, config.max_media_bytes, param)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _http(url, config, param)
    if scheme == "file":
        return _local_file(url, config, param)
    msg = (
        f"{param}: unsupported image URL scheme {scheme or url[:16]!r}; use data:, http(s) or file:"
    )
    raise ImageError(msg, param)


def _too_large(param: str, limit: int) -> ImageError:
    return ImageError(f"{param}: the image is larger than {limit} bytes", param, "image_too_large")


def _data_url(url: str, limit: int, param: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        msg = f"{param}: a data URL must be data:<media type>;base64,<data>"
        raise ImageError(msg, param)
    if len(payload) * 3 // 4 > limit + 3:
        raise _too_large(param, limit)
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{param}: the data URL is not valid base64", param) from None
    if len(data) > limit:
        raise _too_large(param, limit)
    return data


def _check_host(url: str, config, param: str) -> str:
    host = (urlsplit(url).hostname or "").lower()
    allowed = config.allowed_media_domains or ()
    if host not in allowed:
        hint = "the operator allows hosts with --allowed-media-domains"
        raise ImageError(f"{param}: image host {host!r} is not allowed ({hint})", param)
    return host


def _http(url: str, config, param: str) -> bytes:
    host = _check_host(url, config, param)
    deadline = time.monotonic() + config.media_fetch_timeout
    try:
        with httpx.Client(follow_redirects=False, timeout=config.media_fetch_timeout) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                left = deadline - time.monotonic()  # one limit for the hops and the body
                if left <= 0:
                    raise _too_slow(param, config.media_fetch_timeout)
                with client.stream("GET", url, timeout=left) as resp:
                    if resp.is_redirect:
                        url = urljoin(url, resp.headers.get("location", ""))
                        if (urlsplit(url).hostname or "").lower() != host:
                            msg = f"{param}: the image URL redirects to another host; refused"
                            raise ImageError(msg, param)
                        continue
                    if resp.status_code != 200:
                        msg = f"{param}: fetching the image got HTTP {resp.status_code}"
                        raise ImageError(msg, param)
                    return _read_limited(
                        resp, config.max_media_bytes, deadline, param, config.media_fetch_timeout
                    )
    except httpx.TimeoutException:
        raise _too_slow(param, config.media_fetch_timeout) from None
    except httpx.HTTPError as e:
        raise ImageError(
            f"{param}: fetching the image failed ({type(e).__name__})", param
        ) from None
    raise ImageError(f"{param}: more than {_MAX_REDIRECTS} redirects", param)


def _too_slow(param: str, limit_s: float) -> ImageError:
    msg = f"{param}: fetching the image took too long (more than {limit_s:g} s)"
    return ImageError(msg, param)


def _read_limited(resp, limit: int, deadline: float, param: str, limit_s: float) -> bytes:
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(param, limit)
    chunks, size = [], 0
    for chunk in resp.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise _too_large(param, limit)
        if time.monotonic() > deadline:
            raise _too_slow(param, limit_s)
        chunks.append(chunk)
    return b"".join(chunks)


def _local_file(url: str, config, param: str) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        hint = "the operator allows a folder with --allowed-local-media-path"
        raise ImageError(f"{param}: file URLs are not allowed ({hint})", param)
    path = Path(unquote(urlsplit(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()) or not path.is_file():
        raise ImageError(f"{param}: no such file under the allowed media path", param)
    if path.stat().st_size > config.max_media_bytes:
        raise _too_large(param, config.max_media_bytes)
    return path.read_bytes()
