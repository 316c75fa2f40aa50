"""API-key check: deny by default, a short exact-match list of public paths, constant-time compare.

Only the exact paths below are public; everything else (every /v1/* route, /tokenize,
/detokenize, /openapi.json, /docs, any unknown or oddly spelled path, any method including
OPTIONS) needs `Authorization: Bearer <key>` when a key is set. Exact matching on the decoded
path the router itself sees means trailing slashes, case variants, `..` segments and double
slashes can only land on the protected side. (The guard itself maps exactly `/health/` and
`/ping/` to `/health` and `/ping` before this check: probes are often written with the slash.)
"""

from __future__ import annotations

import hmac

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})
METRICS_PATH = "/metrics"


def is_public(path: str, protect_metrics: bool) -> bool:
    # /metrics is public by default like vLLM's (scrapers seldom carry keys); a flag protects it.
    return path in PUBLIC_PATHS or (path == METRICS_PATH and not protect_metrics)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the first Authorization header if its scheme is Bearer (any case)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def is_authorized(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    token = bearer_token(headers)
    # compare_digest on bytes: the time taken does not depend on where the strings differ.
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())
