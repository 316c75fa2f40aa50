"""vLLM's prefix-cache block hashes (--prefix-caching-hash-algo sha256 | sha256_cbor), no torch.

Our own chained hash (engine/core/kv_cache_manager.py hash_block_tokens, the default "builtin")
is private to one server. Routers and KV indexers that compute a block's hash from its token ids
(llm-d's precise prefix-cache scorer, for one) expect vLLM's instead, so with one of vLLM's
algorithm names every block is hashed exactly as vLLM hashes it:

    hash(block) = H((parent hash or NONE_HASH, tuple(token ids), extra keys or None))
    NONE_HASH   = H(os.environ["PYTHONHASHSEED"] if set, else "vllm-none-hash")

where H is SHA-256 over the pickle (protocol 5) of its argument ("sha256", vLLM's default) or
over its canonical CBOR ("sha256_cbor", reproducible outside Python). The extra keys follow
vLLM: ("lora", name, path) for an adapter's requests, ("mm", identifier, offset in the block)
per image in the block, ("cache_salt", salt) on the first block. An image's identifier is our
content hash (hex), so image blocks are vLLM-shaped but not equal to vLLM's, whose identifier
hashes its processed inputs. The KV events carry the low 64 bits (engine/kv_events.py), which is
vLLM's default int form. vLLM's xxhash variants need the optional xxhash package and a seed
shared by all replicas; they are not offered.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's, when PYTHONHASHSEED is unset


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's "sha256": SHA-256 of the pickle (highest protocol) of obj."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's "sha256_cbor": SHA-256 of obj's canonical CBOR (RFC 8949)."""
    return hashlib.sha256(cbor_canonical(obj)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256_pickle,
    "sha256_cbor": sha256_cbor,
}


def _head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(f"CBOR: integer {n} needs a bignum")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR of None, bools, ints below 2**64, bytes, str, tuples and lists: the
    types a block hash's input holds."""
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, (bytes, bytearray)):
        return _head(2, len(obj)) + bytes(obj)
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(obj, (tuple, list)):
        return _head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"CBOR: cannot encode {type(obj).__name__} in a block hash")


class VllmBlockHasher:
    """Chained block hashes as vLLM computes them; seed: None reads PYTHONHASHSEED as vLLM
    does (at construction)."""

    def __init__(self, algo: str, seed: str | None = None) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)} "
                             f"or 'builtin', got {algo!r}")
        self.algo = algo
        self.hash_fn = HASH_FUNCTIONS[algo]
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        self.none_hash = self.hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int],
                   extra_keys: tuple | None = None) -> bytes:
        return self.hash_fn((parent or self.none_hash, tuple(tokens), extra_keys))

    def __call__(self, parent: bytes | None, tokens: Sequence[int], request, start: int) -> bytes:
        """KVCacheManager._block_hashes' hook: the block of request at token start."""
        return self.hash_block(parent, tokens, extra_keys(request, start, start + len(tokens)))


def extra_keys(request, start: int, end: int) -> tuple | None:
    """vLLM's tagged extra keys of the block [start, end): LoRA, images, cache salt."""
    keys: list[tuple] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    for s, n, h in request.mm_spans:
        if end > s and start < s + n:
            keys.append(("mm", h.hex(), s - start))
    if request.cache_salt and start == 0:  # the user's salt; the adapter is keyed above
        keys.append(("cache_salt", request.cache_salt))
    return tuple(keys) or None


def event_extra_keys(keys: tuple | None) -> tuple | None:
    """A block's extra keys as vLLM's BlockStored publishes them: untagged, an image as
    (identifier, offset), anything else as its bare value."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def make_block_hasher(algo: str) -> VllmBlockHasher | None:
    """None for our own hash ("builtin"), else vLLM's named algorithm."""
    return None if algo == "builtin" else VllmBlockHasher(algo)
