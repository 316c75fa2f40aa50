"""KV-cache events (engine/kv_events.py) as a router sees them: a pyzmq SUB socket, frames
(topic, 8-byte big-endian seq, msgpack), decoded with msgspec structs written here after vLLM's
published field order (vllm/distributed/kv_events.py), not the engine's. The events, replayed
into a mirror, must equal what the prefix cache holds, and every stored block's hash must be
the chained hash of the token ids it carries, through hits, evictions, preemption, a
sliding-window model's two groups, a reset; the replay socket and dropped batches too."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from conftest import make_prompts
from test_gemma import build_windowed_dir

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import hash_block_tokens
from engine.core.kv_event_log import split_key

BLOCK = 4


# ---- the consumer's side: vLLM's structs, field for field --------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def ext(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)  # vLLM's int form


class Subscriber:
    """A router's subscriber: live batches from the PUB socket; with a replay endpoint, the
    batches it missed (a SUB joins late: ZMQ's slow joiner) asked for by sequence number."""

    def __init__(self, endpoint: str, topic: str = "kv", replay: str | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.topic, self.replay = topic.encode(), replay
        self.received: dict[int, KVEventBatch] = {}
        self.num_live = self.num_replayed = 0

    @property
    def seqs(self) -> list[int]:
        return sorted(self.received)

    @property
    def batches(self) -> list[KVEventBatch]:
        return [self.received[s] for s in self.seqs]

    def drain(self, publisher, timeout: float = 10.0) -> None:
        """Everything the publisher has sent (it counts what left its queue)."""
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, "events did not arrive"
            if self.sock.poll(200):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == self.topic and len(seq) == 8
                self.received[int.from_bytes(seq, "big")] = DECODER.decode(payload)
                self.num_live += 1
            elif publisher._queue.empty():
                break  # quiet, and nothing left to send
        missing = sorted(set(range(publisher.num_published)) - set(self.received))
        if missing and self.replay:
            for seq, batch in replay_from(self.replay, missing[0]):
                if seq not in self.received:
                    self.received[seq] = batch
                    self.num_replayed += 1


class Mirror:
    """The router's view: (group, hash) -> tokens, kept by the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], list[int]] = {}
        self.full_hash: dict[int, bytes] = {}  # external -> our 32-byte chained hash
        self.num = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.groups: dict[int, tuple[str, int | None]] = {}
        self.num_applied = 0

    def catch_up(self, sub: Subscriber) -> None:
        for batch in sub.batches[self.num_applied :]:
            self.apply(batch)
        self.num_applied = len(sub.batches)

    def apply(self, batch: KVEventBatch) -> None:
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            self.num[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[(event.group_idx, h)]  # KeyError: removed an unknown block
            else:
                self.blocks.clear()

    def _stored(self, e: BlockStored) -> None:
        assert e.block_size == BLOCK and e.medium == "GPU" and e.lora_name is None
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)
        self.groups[e.group_idx] = (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        parent = None if e.parent_block_hash is None else self.full_hash[e.parent_block_hash]
        for i, h in enumerate(e.block_hashes):
            tokens = e.token_ids[i * BLOCK : (i + 1) * BLOCK]
            parent = hash_block_tokens(parent, tokens)  # the chain, from the tokens sent
            assert ext(parent) == h, "a stored hash is not the chained hash of its tokens"
            self.full_hash[h] = parent
            assert (e.group_idx, h) not in self.blocks, "stored twice without a removal"
            self.blocks[(e.group_idx, h)] = tokens

    def assert_matches(self, llm: LLM) -> None:
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        held = {(g, ext(h)) for g, h in map(split_key, pool.cached_block_hash_to_block)}
        assert set(self.blocks) == held


def _llm(model, endpoint: str, **kw) -> LLM:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "topic": "kv", "replay_endpoint": endpoint + "-replay"}
    return LLM(str(model), dtype="float32", block_size=BLOCK, max_model_len=256,
               kv_events_config=config, **kw)


def _run(llm: LLM, sub: Subscriber, mirror: Mirror, prompts, max_tokens: int = 6) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    sub.drain(llm.engine.kv_events)
    mirror.catch_up(sub)
    mirror.assert_matches(llm)
    return outs


@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/kv-events"


def test_events_follow_hits_evictions_preemption_and_reset(tiny_model_dir, endpoint):
    llm = _llm(tiny_model_dir, endpoint, num_gpu_blocks_override=24)
    sub, mirror = Subscriber(endpoint, replay=endpoint + "-replay"), Mirror()
    shared = list(range(10, 26))  # 4 full blocks every prompt shares
    prompts = [shared + p for p in make_prompts(3, seed=1, min_len=5, max_len=9)]
    _run(llm, sub, mirror, prompts[:1])
    stored = mirror.num["BlockStored"]
    assert stored and mirror.groups == {0: ("full_attention", None)}
    outs = _run(llm, sub, mirror, prompts[1:])  # hits on the shared blocks: not stored again
    assert all(o.num_cached_tokens >= len(shared) for o in outs)
    # long prompts through a 24-block pool: cached blocks are evicted, requests preempted
    _run(llm, sub, mirror, make_prompts(6, seed=2, min_len=30, max_len=50), max_tokens=24)
    assert mirror.num["BlockRemoved"] > 0
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert sub.seqs == list(range(len(sub.seqs)))  # nothing dropped, in order
    assert llm.engine.kv_events.num_dropped == 0
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.reset_prefix_cache()
    llm.engine.publish_kv_events()
    sub.drain(llm.engine.kv_events)
    mirror.catch_up(sub)
    assert mirror.num["AllBlocksCleared"] == 1 and not mirror.blocks
    mirror.assert_matches(llm)
    assert sub.num_live > 0
    replayed = replay_from(endpoint + "-replay", 2)  # same payloads as the live ones
    assert [s for s, _ in replayed] == sub.seqs[2:]
    assert [b.events for _, b in replayed] == [b.events for b in sub.batches[2:]]
    llm.engine.shutdown()


def replay_from(replay_endpoint: str, first: int) -> list[tuple[int, KVEventBatch]]:
    """A DEALER asks for everything from seq `first`: the buffered payloads, then the end mark."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    got = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    dealer.close(linger=0)
    return got


def test_sliding_window_model_publishes_every_group(tmp_path, endpoint):
    path = build_windowed_dir(tmp_path / "m", "gemma2")  # groups: full (0), window 8 (1)
    llm = _llm(path, endpoint, num_gpu_blocks_override=40)
    sub, mirror = Subscriber(endpoint, replay=endpoint + "-replay"), Mirror()
    shared = list(range(30, 46))
    _run(llm, sub, mirror, [shared + [7, 8, 9]], max_tokens=20)
    assert mirror.groups == {0: ("full_attention", None), 1: ("sliding_window", 8)}
    prompts = [shared + p for p in make_prompts(2, seed=3, min_len=3, max_len=6)]
    outs = _run(llm, sub, mirror, prompts)
    assert all(o.num_cached_tokens > 0 for o in outs)
    _run(llm, sub, mirror, make_prompts(5, seed=4, min_len=25, max_len=40), max_tokens=20)
    assert mirror.num["BlockRemoved"] > 0
    llm.engine.shutdown()


def test_a_full_queue_drops_batches_and_the_seq_shows_the_gap(endpoint):
    from engine.kv_events import AllBlocksCleared as Cleared
    from engine.kv_events import KVEventsConfig, ZmqEventPublisher

    config = KVEventsConfig.parse(
        {"enable_kv_cache_events": True, "endpoint": endpoint, "max_queue_size": 2}
    )
    assert config.publisher == "zmq" and config.topic == "" and config.buffer_steps == 10_000
    publisher = ZmqEventPublisher(config)
    sub = Subscriber(endpoint, topic="")
    time.sleep(1.0)  # a SUB connects asynchronously (no replay socket here to fill a miss)
    publisher._running = False  # the thread stops taking batches: the queue fills
    publisher._thread.join(2)
    start = time.perf_counter()
    for _ in range(50):
        publisher.publish([Cleared()])
    assert time.perf_counter() - start < 0.05  # the step loop never waits on the queue
    assert publisher.num_dropped == 48
    publisher._running = True  # a fresh thread drains what was queued
    publisher._thread = __import__("threading").Thread(target=publisher._run, daemon=True)
    publisher._thread.start()
    publisher.publish([Cleared()])
    sub.drain(publisher)
    assert sub.seqs == [0, 1, 50]  # 2..49 dropped: the gap a subscriber sees
    publisher.shutdown()


def test_config_takes_vllm_keys_and_names_a_bad_one():
    from engine.kv_events import KVEventsConfig

    assert KVEventsConfig.parse("{}").publisher == "null"
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    with pytest.raises(ValueError, match="endpont"):
        KVEventsConfig.parse('{"endpont": "tcp://*:5557"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "kafka"}')
