"""The block pool's KV-cache event log, told in request terms (no torch, no sockets).

The pool records ("stored", key), ("removed", key) and ("cleared",) as it registers, evicts
and forgets prefix-cache hashes. A key is a block's chained hash, with a group suffix for KV
cache groups after the first (engine/core/kv_cache_groups.py). describe_stored() rewrites the
stored keys one allocation registered as runs of consecutive blocks with their tokens and
parent, the shape vLLM's BlockStored carries; engine/kv_events.py turns the log into events.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.block_hashing import event_extra_keys, extra_keys

HASH_LEN = 32  # sha256: ours (kv_cache_manager.py hash_block_tokens) and vLLM's (block_hashing.py)


def split_key(key: bytes) -> tuple[int, bytes]:
    """(group index, chained hash) of a prefix-cache key."""
    if len(key) == HASH_LEN:
        return 0, key
    return int.from_bytes(key[HASH_LEN + 1 : HASH_LEN + 3], "little"), key[:HASH_LEN]


def stored_info(request, vllm_hasher, block_size: int) -> Callable[[int, int], tuple]:
    """describe_stored's info for one request's blocks first..last: (LoRA adapter name or None,
    its int id or None, one untagged extra-keys entry per block or None). The extra keys are
    those of vLLM's hash; under our own hash only the images' (the same values: a block
    holding an image's tokens always names it), not the adapter's (ours keys its content,
    vLLM's its name and path) nor the cache salt (ours hashes it; it stays off the socket)."""
    lora = getattr(request, "lora_request", None)
    name, lora_id = (lora.name, lora.lora_int_id) if lora is not None else (None, None)

    def block_keys(start: int) -> tuple | None:
        keys = extra_keys(request, start, start + block_size)
        if vllm_hasher is None and keys is not None:
            keys = tuple(k for k in keys if k[0] == "mm") or None
        return event_extra_keys(keys)

    def info(first: int, last: int) -> tuple:
        keys = [block_keys(i * block_size) for i in range(first, last + 1)]
        return name, lora_id, (keys if any(k is not None for k in keys) else None)

    return info


def describe_stored(
    log: list[tuple], mark: int, hashes: list[bytes], tokens: list[int], block_size: int,
    info: Callable[[int, int], tuple] | None = None,
) -> None:
    """Rewrites log[mark:]'s ("stored", key) entries, registered for one request, in place as
    ("stored", group, block hashes, parent hash or None, token ids, info): one entry per run of
    consecutive blocks of one group; info is stored_info's tuple (None: no LoRA, no extra
    keys)."""
    out = log[:mark]
    run: list[int] | None = None  # [group, first block, last block]

    def flush() -> None:
        if run is not None:
            group, first, last = run
            parent = hashes[first - 1] if first else None
            span = tokens[first * block_size : (last + 1) * block_size]
            meta = info(first, last) if info is not None else (None, None, None)
            out.append(("stored", group, hashes[first : last + 1], parent, list(span), meta))

    for event in log[mark:]:
        if event[0] != "stored":
            flush()
            run = None
            out.append(event)
            continue
        group, chained = split_key(event[1])
        i = _index_from_end(hashes, chained)
        if run is not None and run[0] == group and run[2] == i - 1:
            run[2] = i
        else:
            flush()
            run = [group, i, i]
    flush()
    log[:] = out


def _index_from_end(hashes: list[bytes], chained: bytes) -> int:
    """Blocks are registered as they fill, so the hash is almost always near the end."""
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] == chained:
            return i
    raise AssertionError("a stored block's hash is not among the request's hashes")
