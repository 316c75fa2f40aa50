"""--prefix-caching-hash-algo (engine/core/block_hashing.py): with vLLM's algorithm names the
prefix cache hashes blocks exactly as vLLM does, and the KV events carry those hashes and the
LoRA adapter's name. The expected values are computed here from vLLM's documented algorithm
(cbor2 / pickle + hashlib), and, where vLLM's CPU build is installed (bench/), by vLLM itself."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import time
from pathlib import Path

import cbor2
import pytest
from test_kv_events import BlockStored, Subscriber, ext
from test_lora import ATTN, build_adapter

from engine.config import EngineConfig
from engine.core.block_hashing import VllmBlockHasher, cbor_canonical
from engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.core.request import Request
from engine.kv_events import to_events
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

BS = 4
TOKENS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(226, 259))]  # ids < vocab
VLLM_PY = Path(__file__).resolve().parents[1] / "bench/.venv-vllm/bin/python"
VLLM_PY = VLLM_PY if VLLM_PY.exists() else Path("/work/main/bench/.venv-vllm/bin/python")



def _run_in_vllm(script: str) -> dict:
    """Runs a script with vLLM's own Python (no PYTHONHASHSEED) and reads its last line's JSON."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    run = subprocess.run([str(VLLM_PY), "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])

def serialize(algo: str, obj) -> bytes:
    """vLLM's serializations, by the reference libraries (not the engine's encoder)."""
    if algo == "sha256_cbor":
        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def expected_chain(algo: str, tokens, extra=None, seed: str = "vllm-none-hash",
                   parent: bytes | None = None) -> list[bytes]:
    """vLLM's chain: NONE_HASH = H(seed); block i = H((parent, tuple(tokens), extra keys))."""
    parent = parent or hashlib.sha256(serialize(algo, seed)).digest()
    out = []
    for i in range(len(tokens) // BS):
        block = tuple(tokens[i * BS : (i + 1) * BS])
        parent = hashlib.sha256(serialize(algo, (parent, block, extra))).digest()
        out.append(parent)
    return out


def ours(algo: str, tokens, extra=None, seed: str | None = None) -> list[bytes]:
    hasher, parent, out = VllmBlockHasher(algo, seed), None, []
    for i in range(len(tokens) // BS):
        parent = hasher.hash_block(parent, tokens[i * BS : (i + 1) * BS], extra)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_chains_equal_vllms_documented_algorithm(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    lora = (("lora", "sql", "/adapters/sql"),)
    for tokens in TOKENS:
        assert ours(algo, tokens) == expected_chain(algo, tokens)
        assert ours(algo, tokens, lora) == expected_chain(algo, tokens, lora)
        assert ours(algo, tokens, lora) != ours(algo, tokens)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # vLLM's seed when set: NONE_HASH = H("0")
    assert ours(algo, TOKENS[0]) == expected_chain(algo, TOKENS[0], seed="0")
    assert ours(algo, TOKENS[0]) != expected_chain(algo, TOKENS[0])


def test_cbor_encoder_is_canonical_cbor():
    values = [None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -24,
              -25, -(2**40), b"", b"\x00" * 40, "", "lora", "é" * 30, (1, (2, [3])), [], ()]
    for v in values:
        assert cbor_canonical(v) == cbor2.dumps(v, canonical=True), v


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM's CPU build (bench/.venv-vllm) absent")
def test_chains_equal_vllms_own_hash_function():
    script = f"""
import json
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
out = {{}}
for algo in ("sha256", "sha256_cbor"):
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    for i, tokens in enumerate({TOKENS!r}):
        for extra in (None, (("lora", "sql", "/adapters/sql"),)):
            parent, chain = None, []
            for b in range(len(tokens) // {BS}):
                parent = k.hash_block_tokens(fn, parent, tokens[b * {BS}:(b + 1) * {BS}], extra)
                chain.append(bytes(parent).hex())
            out[f"{{algo}} {{i}} {{extra is not None}}"] = chain
print(json.dumps(out))
"""
    theirs = _run_in_vllm(script)
    assert len(theirs) == 8
    for key, chain in theirs.items():
        algo, i, has_extra = key.split()
        extra = (("lora", "sql", "/adapters/sql"),) if has_extra == "True" else None
        assert [h.hex() for h in ours(algo, TOKENS[int(i)], extra)] == chain, key


def _stored_events(algo: str, lora: LoRARequest | None, tokens: list[int],
                   salt: str | None = None) -> list:
    kv = KVCacheManager(32, BS, block_hash_algo=algo)
    kv.enable_kv_events()
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    req.lora_request, req.cache_salt = lora, salt
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(tokens), hits, num_hit) is not None
    return [e for e in to_events(kv.take_kv_events(), BS, (0,)) if e.__class__.__name__ ==
            "BlockStored"]


def test_manager_hashes_and_events_carry_vllms_hashes_and_the_adapter(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = TOKENS[1]
    lora = LoRARequest("sql", 3, "/adapters/sql", "ab" * 32)
    for algo in ("sha256", "sha256_cbor"):
        (base,) = _stored_events(algo, None, tokens)
        assert base.block_hashes == [ext(h) for h in expected_chain(algo, tokens)]
        assert base.lora_name is None and base.lora_id is None and base.extra_keys is None
        (adapted,) = _stored_events(algo, lora, tokens)
        want = expected_chain(algo, tokens, (("lora", "sql", "/adapters/sql"),))
        assert adapted.block_hashes == [ext(h) for h in want]
        assert (adapted.lora_name, adapted.lora_id) == ("sql", 3)
        assert adapted.extra_keys == [("sql",)] * len(want)  # vLLM's untagged form
    (builtin,) = _stored_events("builtin", lora, tokens)  # ours: the adapter's content salt
    assert (builtin.lora_name, builtin.lora_id, builtin.extra_keys) == ("sql", 3, None)
    chain, parent = [], None
    for i in range(len(tokens) // BS):
        salt = lora.cache_salt if i == 0 else b""
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], salt)
        chain.append(ext(parent))
    assert builtin.block_hashes == chain


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo.*xxhash"):
        EngineConfig(prefix_caching_hash_algo="xxhash")


@pytest.mark.parametrize("algo", ["builtin", "sha256_cbor"])
def test_engine_events_name_the_adapter(algo, tiny_model_dir, tmp_path, monkeypatch):
    """Through the engine and the ZMQ publisher: an adapter's blocks carry its name, the base
    model's none; with vLLM's hash every stored hash is vLLM's chain of the tokens sent."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    adapter = build_adapter(tiny_model_dir, tmp_path / "sql", 1, 4, ATTN, lora_alpha=8)
    endpoint = f"ipc://{tmp_path}/kv"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv"}
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", block_size=BS,
        enable_lora=True, lora_modules=(f"sql={adapter}",), kv_events_config=events,
        prefix_caching_hash_algo=algo))
    sub = Subscriber(endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: subscribe before the first batch
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("base", TOKENS[0], params)
    engine.add_request("sql", TOKENS[1], params, lora_name="sql")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("again", TOKENS[0], params)  # a prefix hit under either hash
    cached = [o.num_cached_tokens for o in engine.step()[0]]
    while engine.has_unfinished_requests():
        cached += [o.num_cached_tokens for o in engine.step()[0]]
    assert max(cached) == 12  # 3 full blocks of the 13-token prompt
    sub.drain(engine.kv_events)
    stored = [e for b in sub.batches for e in b.events if isinstance(e, BlockStored)]
    by_lora = {e.lora_name: e for e in stored}
    assert set(by_lora) == {None, "sql"} and by_lora["sql"].lora_id is not None
    if algo == "sha256_cbor":
        key, full = (("lora", "sql", str(adapter)),), {}
        for e in stored:  # each run of blocks chains on from its parent's full hash
            extra = key if e.lora_name == "sql" else None
            parent = full[e.parent_block_hash] if e.parent_block_hash is not None else None
            want = expected_chain(algo, e.token_ids, extra, parent=parent)
            assert e.block_hashes == [ext(h) for h in want]
            full.update(zip(e.block_hashes, want))
    engine.shutdown()


def test_extra_keys_follow_vllms_tags_for_images_and_salt():
    """vLLM's _gen_mm_extra_hash_keys: ("mm", identifier, image offset - block start) for every
    block the image's placeholders touch; the cache salt on the first block only."""
    from engine.core.block_hashing import event_extra_keys, extra_keys

    req = Request("r", list(range(3, 19)), SamplingParams(max_tokens=1))
    img = b"\x01" * 32
    req.mm_spans, req.cache_salt = [(6, 5, img)], "user-salt"
    keys = [extra_keys(req, s, s + BS) for s in range(0, 16, BS)]
    assert keys == [(("cache_salt", "user-salt"),), (("mm", img.hex(), 2),),
                    (("mm", img.hex(), -2),), None]
    assert event_extra_keys(keys[1]) == ((img.hex(), 2),)
    assert event_extra_keys(keys[0]) == ("user-salt",)


SQL = LoRARequest("sql", 3, "/adapters/sql", "ab" * 32)
SQL_KEY = ("lora", "sql", "/adapters/sql")


def salted_chain(algo: str, tokens, salt: str, lora_key: tuple | None = None) -> list[bytes]:
    """vLLM's keys, written out: the adapter's on every block, ("cache_salt", salt) after it on
    the first block only."""
    base = (lora_key,) if lora_key else ()
    first = expected_chain(algo, tokens[:BS], (*base, ("cache_salt", salt)))
    return first + expected_chain(algo, tokens[BS:], base or None, parent=first[-1])


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_salted_blocks_hash_as_vllms_with_and_without_an_adapter(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = TOKENS[1]
    (salted,) = _stored_events(algo, None, tokens, "tenant-a")
    want = salted_chain(algo, tokens, "tenant-a")
    assert salted.block_hashes == [ext(h) for h in want]
    assert salted.extra_keys == [("tenant-a",)] + [None] * (len(want) - 1)
    assert want[0] != expected_chain(algo, tokens)[0]  # the salt is in the hash
    (both,) = _stored_events(algo, SQL, tokens, "tenant-a")
    want = salted_chain(algo, tokens, "tenant-a", SQL_KEY)
    assert both.block_hashes == [ext(h) for h in want]
    assert both.extra_keys == [("sql", "tenant-a")] + [("sql",)] * (len(want) - 1)
    assert (both.lora_name, both.lora_id) == ("sql", 3)


@pytest.mark.parametrize("algo", ["builtin", "sha256", "sha256_cbor"])
def test_salts_and_adapters_each_split_the_cache(algo):
    """Same tokens: blocks are shared only when salt and adapter are both equal."""
    kv = KVCacheManager(64, BS, block_hash_algo=algo)
    tokens, other = TOKENS[0], LoRARequest("chat", 4, "/adapters/chat", "cd" * 32)
    identities = [(None, None), ("a", None), ("b", None), (None, SQL), ("a", SQL), ("a", other)]
    for i, (salt, lora) in enumerate(identities):
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1))
        req.cache_salt, req.lora_request = salt, lora
        assert kv.get_computed_blocks(req)[1] == 0, (salt, lora)  # nobody else's blocks
        assert kv.allocate_slots(req, len(tokens)) is not None
        again = Request(f"again{i}", tokens, SamplingParams(max_tokens=1))
        again.cache_salt, again.lora_request = salt, lora
        assert kv.get_computed_blocks(again)[1] == 12, (salt, lora)  # its own: a hit


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM's CPU build (bench/.venv-vllm) absent")
def test_salted_chains_equal_vllms_own_extra_keys(monkeypatch):
    """vLLM's generate_block_hash_extra_keys on a request with a salt (and an adapter)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = TOKENS[1]
    script = f"""
import json
from types import SimpleNamespace as NS
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
out = {{}}
lora = NS(lora_name="sql", lora_path="/adapters/sql")
for algo in ("sha256", "sha256_cbor"):
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    for with_lora in (False, True):
        req = NS(mm_features=[], lora_request=lora if with_lora else None,
                 cache_salt="tenant-a", prompt_embeds=None)
        parent, chain = None, []
        for b in range(len({tokens!r}) // {BS}):
            extra, _ = k.generate_block_hash_extra_keys(req, b * {BS}, (b + 1) * {BS}, 0)
            parent = k.hash_block_tokens(fn, parent, {tokens!r}[b * {BS}:(b + 1) * {BS}], extra)
            chain.append(bytes(parent).hex())
        out[f"{{algo}} {{with_lora}}"] = chain
print(json.dumps(out))
"""
    theirs = _run_in_vllm(script)
    assert len(theirs) == 4
    for key, chain in theirs.items():
        algo, with_lora = key.split()
        req = Request("r", tokens, SamplingParams(max_tokens=1))
        req.cache_salt, req.lora_request = "tenant-a", SQL if with_lora == "True" else None
        hasher, parent, mine = VllmBlockHasher(algo), None, []
        for start in range(0, len(tokens) - BS + 1, BS):
            parent = hasher(parent, tokens[start : start + BS], req, start)
            mine.append(parent.hex())
        assert mine == chain, key
