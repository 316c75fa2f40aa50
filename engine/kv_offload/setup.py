"""Wires the second KV tier into an engine: the disk store, the runner's hook, the scheduler's
KVTier, and the flush of the pool's cached blocks at shutdown (so a restart finds them).

--kv-offloading-size GiB turns it on. --kv-offloading-backend native (vLLM's default): host
memory (engine/kv_offload/host_store.py) when the pool is on a GPU; on CPU, where the pool
already is host memory, files under --kv-offloading-dir. disk / cpu choose the files / host
memory wherever the pool is.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from engine.core.kv_swap import KVSwap
from engine.core.kv_tier import KVTier
from engine.kv_offload.disk_store import DiskKVStore
from engine.kv_offload.runner_hook import KVOffloadHook

logger = logging.getLogger(__name__)

FORMAT_VERSION = b"pagedserve-kv-tier-1"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "vocab.txt",
)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_SAMPLE = 1 << 20  # bytes hashed from each end of a weight file


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve" / "kv_tier"


def fingerprint(model_dir: Path, dtype: str, block_size: int, layout: tuple, extra: tuple) -> bytes:
    """What must match for a stored block to be reused: the model (config, and each weight
    file's name, size and first and last MiB), the tokenizer files, dtype, block size, the KV
    layout and whatever else changes the KV (quantization)."""
    h = hashlib.sha256(FORMAT_VERSION)
    h.update(repr((dtype, block_size, layout, extra)).encode())
    model_dir = Path(model_dir)
    for name in ("config.json", *_TOKENIZER_FILES):
        path = model_dir / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.digest()


def runner_fingerprint(cfg, model_dir, runner) -> bytes:
    """fingerprint() for this runner's KV: its layout, and the TP size and rank (a shard)."""
    spec, tp = runner.kv_cache_spec, runner.tp
    layout = (spec.windows, spec.layer_groups, runner.num_kv_heads, runner.head_dim)
    layout += (tp.world_size, tp.rank)
    extra = (cfg.quantization, cfg.gguf_weights)
    return fingerprint(model_dir, str(runner.dtype), cfg.block_size, layout, extra)


class KVOffload:
    """The tier of one engine: store (disk), hook (runner), tier (scheduler)."""

    def __init__(self, store: DiskKVStore, hook: KVOffloadHook, tier: KVTier) -> None:
        self.store, self.hook, self.tier = store, hook, tier

    def shutdown(self) -> None:
        """Write every block still cached in the pool, then finish the queued writes."""
        if getattr(self.store, "persistent", True):  # a host-memory tier dies with the process
            self.hook.store_blocks(self.tier.cached_blocks())
        self.store.close()


def uses_host_memory(backend: str | None, device_type: str) -> bool:
    """Whether the tier is host memory: cpu, or native (the default) with the pool on a GPU."""
    return backend == "cpu" or (backend in (None, "native") and device_type != "cpu")


def attach_kv_offload(engine, store_cls=DiskKVStore) -> KVOffload | None:
    """Builds the tier for engine when its config asks for one (None otherwise)."""
    cfg = engine.config
    if cfg.kv_offloading_size is None:
        return None
    directory = Path(cfg.kv_offloading_dir) if cfg.kv_offloading_dir else default_dir()
    if getattr(engine.executor, "runner", None) is None:  # worker processes (mp executor)
        if cfg.kv_offloading_backend == "cpu":
            raise ValueError("kv_offloading_backend cpu needs one process (tensor parallel: disk)")
        from engine.kv_offload.tp_index import attach_ranked_kv_offload

        return attach_ranked_kv_offload(engine, directory)
    runner = engine.executor.runner
    if store_cls is DiskKVStore and uses_host_memory(cfg.kv_offloading_backend, runner.device.type):
        return _attach_host(engine, runner)
    fp = runner_fingerprint(cfg, engine.model_dir, runner)
    store = store_cls(directory, int(cfg.kv_offloading_size * 2**30), fp)
    hook = KVOffloadHook(runner.kv_caches, store)
    manager = engine.scheduler.kv_cache_manager
    tier = KVTier(manager, store)
    manager.tier = tier
    engine.scheduler.kv_tier = tier
    tier.swap = engine.scheduler.kv_swap = KVSwap(manager, store, hook.block_bytes)
    runner.kv_offload = hook
    logger.info(
        "KV tier: %.2f GiB on disk in %s (%d KiB per block)",
        cfg.kv_offloading_size,
        store.directory,
        hook.block_bytes // 1024,
    )
    return KVOffload(store, hook, tier)


def _attach_host(engine, runner) -> KVOffload:
    """The host-memory tier: one object is the store and the runner's hook."""
    from engine.kv_offload.host_store import HostKVStore

    size = engine.config.kv_offloading_size
    store = HostKVStore(runner.kv_caches, int(size * 2**30))
    manager = engine.scheduler.kv_cache_manager
    tier = KVTier(manager, store)
    manager.tier = tier
    engine.scheduler.kv_tier = tier
    runner.kv_offload = store
    tier.swap = engine.scheduler.kv_swap = KVSwap(manager, store, store.block_bytes)
    logger.info(
        "KV tier: %.2f GiB of host memory%s (%d blocks of %d KiB)",
        size,
        ", pinned" if store.cuda else "",
        store.capacity_blocks,
        store.block_bytes // 1024,
    )
    return KVOffload(store, store, tier)
