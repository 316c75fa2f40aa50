"""KV-cache events with images (issue 46 item 4), as a router sees them through the ZMQ
publisher: every stored block that holds an image's placeholder tokens carries that image's
content hash as vLLM's extra key (identifier, image offset - block start), text blocks carry
none, and two different images behind identical placeholder tokens give different hashes."""

from __future__ import annotations

import time

import pytest
from test_kv_events import BlockStored, Subscriber
from test_multimodal import build_tiny_llava_dir, generate, image_prompt, make_engine, random_image

BS = 4


def stored_blocks(sub: Subscriber, engine, skip: int) -> list[tuple[int, list[int], tuple | None]]:
    """(hash, token ids, extra key) of every block stored in the batches after `skip`."""
    sub.drain(engine.kv_events)
    blocks = []
    for batch in sub.batches[skip:]:
        for e in batch.events:
            if isinstance(e, BlockStored):
                keys = e.extra_keys or [None] * len(e.block_hashes)
                for i, (h, key) in enumerate(zip(e.block_hashes, keys)):
                    key = tuple(tuple(k) for k in key) if key is not None else None
                    blocks.append((h, e.token_ids[i * BS : (i + 1) * BS], key))
    return blocks


def expected_keys(ids: list[int], image) -> list[tuple | None]:
    """Per full prompt block: the image's (hex hash, offset from the block's start), if any of
    its placeholder tokens lie in the block."""
    keys = []
    for lo in range(0, len(ids) // BS * BS, BS):
        inside = image.start < lo + BS and lo < image.start + image.length
        keys.append(((image.content_hash.hex(), image.start - lo),) if inside else None)
    return keys


@pytest.mark.parametrize("algo", ["builtin", "sha256_cbor"])  # our hash and vLLM's
def test_stored_blocks_carry_the_image_hash(algo, tmp_path):
    path = build_tiny_llava_dir(tmp_path / "llava")
    endpoint = f"ipc://{tmp_path}/kv"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}  # fmt: skip
    engine = make_engine(
        path, block_size=BS, kv_events_config=events, prefix_caching_hash_algo=algo
    )
    try:
        sub = Subscriber(endpoint)
        time.sleep(0.3)  # ZMQ's slow joiner: subscribe before the first batch
        runs = {}
        for name, seed in (("a", 1), ("b", 2)):  # the same text, different images
            ids, inputs = image_prompt(engine, "describe the picture please", [random_image(seed)])
            skip = len(sub.batches)
            generate(engine, {name: (ids, inputs)})
            runs[name] = (ids, inputs[0], stored_blocks(sub, engine, skip))
        hashes = {}
        for name, (ids, image, blocks) in runs.items():
            want = expected_keys(ids, image)
            assert [key for _, _, key in blocks[: len(want)]] == want, name
            assert [t for _, toks, _ in blocks[: len(want)] for t in toks] == ids[: len(want) * BS]
            assert any(want) and all(key is None for _, _, key in blocks[len(want) :])
            hashes[name] = {h for h, _, key in blocks if key is not None}
        assert runs["a"][0] == runs["b"][0]  # identical placeholder and text tokens
        assert not hashes["a"] & hashes["b"]  # yet no image block shares a hash
    finally:
        engine.shutdown()


def test_builtin_hash_events_name_images_but_never_the_salt():
    """Our own hash keys the cache salt by its sha256; the events must not publish it."""
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.request import Request
    from engine.kv_events import to_events
    from engine.sampling_params import SamplingParams

    kv = KVCacheManager(32, BS, block_hash_algo="builtin")
    kv.enable_kv_events()
    req = Request("r", list(range(3, 19)), SamplingParams(max_tokens=1))
    img = b"\x02" * 32
    req.mm_spans, req.cache_salt = [(6, 5, img)], "tenant-secret"
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 16, hits, num_hit) is not None
    (stored,) = [e for e in to_events(kv.take_kv_events(), BS, (0,)) if hasattr(e, "token_ids")]
    assert stored.extra_keys == [None, ((img.hex(), 2),), ((img.hex(), -2),), None]
