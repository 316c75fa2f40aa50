"""KV-cache events in vLLM's wire format, for prefix-cache-aware routers (llm-d, Dynamo, ...).

`--kv-events-config` takes vLLM's JSON keys. The engine thread hands each step's events
(engine/core/kv_event_log.py) to publish(), which converts them to msgspec structs and puts
one batch on a bounded queue: it never waits. A publisher thread owns the ZMQ sockets and
sends each batch as three frames: topic, an 8-byte big-endian sequence number, and the
msgpack of EventBatch, the positional `[ts, events, data_parallel_rank]` whose events are maps
tagged with `type` (BlockStored, BlockRemoved, AllBlocksCleared). When the queue is full the
batch is dropped and counted: the sequence number is taken as the batch is queued, so a
subscriber sees the gap and can ask the replay socket (ROUTER: a request is the first wanted
sequence number, 8 bytes big-endian; the answer is every buffered batch from there as
(b"", topic, seq, payload), then (b"", b"", -1 as 8 bytes, b"")).

Binding follows vLLM: an endpoint with `*` or `::`, or an ipc:// / inproc:// one, is bound;
any other is connected to. The events carry prompt token ids: keep the port inside the
cluster (docs/operations.md, Security).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's medium name for the device pool (ours on CPU too)


# ---- vLLM's structs (vllm/distributed/kv_events.py): same names, same field order ----------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tag=True writes the class name as the `type` key."""


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


def external_hash(block_hash: bytes) -> int:
    """vLLM's default external form of a block hash: the low 64 bits, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str) -> KVEventsConfig:
        """From the JSON text of --kv-events-config or a dict; ValueError names a bad key."""
        if isinstance(value, cls):
            return value
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; known: {sorted(known)}")
        config = cls(**data)
        if config.publisher is None:
            publisher = "zmq" if config.enable_kv_cache_events else "null"
            config = cls(**{**data, "publisher": publisher})
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got "
                             f"{config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# ---- engine-side conversion ---------------------------------------------------------------
def to_events(log: list[tuple], block_size: int, windows: tuple[int, ...]) -> list:
    """KVCacheManager.take_kv_events()'s entries as vLLM's event structs."""
    out: list = []
    for entry in log:
        kind = entry[0]
        if kind == "stored":
            _, group, hashes, parent, token_ids, (lora_name, lora_id, extra_keys) = entry
            window = windows[group] if group < len(windows) else 0
            out.append(BlockStored(
                block_hashes=[external_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=token_ids, block_size=block_size, lora_id=lora_id, medium=MEDIUM_GPU,
                lora_name=lora_name, extra_keys=extra_keys, group_idx=group,
                kv_cache_spec_kind="sliding_window" if window else "full_attention",
                kv_cache_spec_sliding_window=window or None,
            ))
        elif kind == "removed":
            _, group, chained = entry
            out.append(BlockRemoved(
                block_hashes=[external_hash(chained)], medium=MEDIUM_GPU, group_idx=group
            ))
        else:
            out.append(AllBlocksCleared())
    return out


class ZmqEventPublisher:
    """PUB socket (+ optional ROUTER replay socket) fed by a bounded queue and one thread."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._topic = config.topic.encode()
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_published = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        _bind_or_connect(self._pub, config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """From the engine thread: never blocks; a full queue drops the batch (counted)."""
        seq = next(self._seq)
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            seq, batch = item
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published += 1
            except Exception:  # a send error must not end the thread
                logger.exception("kv events: publishing batch %d failed", seq)
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: bad replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _bind_or_connect(sock, endpoint: str) -> None:
    """vLLM's rule: wildcard hosts and ipc/inproc endpoints bind, anything else connects."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def create_publisher(config, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """None when events are off (no config, disabled, or publisher 'null')."""
    if config is None:
        return None
    config = KVEventsConfig.parse(config)
    return ZmqEventPublisher(config, data_parallel_rank) if config.enabled else None
