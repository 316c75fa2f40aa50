"""The runner's side of multi-LoRA: adapters kept loaded, the step's slots, the per-token index.

Adapters are keyed by content hash: a reload with new weights under an old name is a new
adapter (new slot contents, new prefix-cache salt). At most --max-cpu-loras stay loaded (LRU);
one evicted and asked for again is read back from its folder, at admission (`admit`): a folder
gone or changed by then refuses the request, never a step. An admitted request's adapter stays
in memory (pinned, evicted or not) until the request is gone. A step's distinct adapters take
the --max-loras slots (a slot already holding one is reused without a copy).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from engine.layers.lora import LoRABatch, LoRALinearWeights
from engine.lora.adapter import BaseShapes, LoRAAdapter, load_adapter
from engine.lora.request import LoRAError, LoRARequest, content_hash
from engine.lora.sharding import full_shape, shard_adapter, wrap
from pagedserve_kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger(__name__)

_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _linears_of(layer: nn.Module) -> dict[str, nn.Module]:
    """The decoder layer's dense projections that adapters can target (an MoE MLP has none)."""
    found = {}
    for owner in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
        for name in _PARTS:
            lin = getattr(owner, name, None) if owner is not None else None
            if lin is not None and hasattr(lin, "in_features"):
                found[name] = lin
    return found


def _hf_names(name: str, model: nn.Module) -> tuple[str, ...]:
    """The Hugging Face modules (PEFT's target names) a linear of ours stands for: q/k/v and
    gate/up apart, or, for a model whose HF class fuses them (Phi-3), the fused linear itself."""
    fused = getattr(model, "lora_fused_targets", ())
    return (name,) if name in fused else _PARTS[name]


def _split_fused(ab, sizes: list[int]) -> list:
    """One adapter over a whole fused linear (A [r, in], B [sum(sizes), r]) as per-part
    adapters: A shared by every part, B's rows split as the linear stacks its outputs."""
    if ab is None:
        return [None] * len(sizes)
    a, b = ab
    return [(a, rows) for rows in b.split(sizes)]


def _part_sizes(name: str, lin: nn.Module) -> list[int]:
    if name == "qkv_proj":
        return [lin.q_size, lin.kv_size, lin.kv_size]
    if name == "gate_up_proj":
        return [lin.part_size, lin.part_size]
    return [lin.out_features]


class LoRAManager:
    def __init__(self, model: nn.Module, config, dtype, device) -> None:
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        ops = load_cpu_ops() if torch.device(device).type == "cpu" else None
        if ops is not None and not hasattr(ops, "lora_add"):
            ops = None  # a kernel build older than lora.cpp
        self.batch = LoRABatch(config.max_loras, self.max_rank, dtype, device, ops)
        self.device = device
        self.layers: list[dict[str, LoRALinearWeights]] = []
        self._linear_of: dict[str, nn.Module] = {}  # HF module -> a linear (its TP sharding)
        modules: dict[str, tuple[int, int]] = {}
        layer_modules: list[frozenset[str]] = []
        self.hf_names = {name: _hf_names(name, model) for name in _PARTS}
        for layer in model.model.layers:
            found = {}
            for name, lin in _linears_of(layer).items():
                sizes = _part_sizes(name, lin)
                weights = LoRALinearWeights(lin.in_features, sizes, self.batch, dtype, device)
                wrap(lin, weights)  # a row-parallel one: before its all-reduce
                found[name] = weights
                hf = self.hf_names[name]
                outs = [sum(sizes)] if len(hf) == 1 else sizes  # a fused HF module: one pair
                for hf_name, size in zip(hf, outs):
                    modules[hf_name] = full_shape(hf_name, lin, size)  # checked unsharded
                    self._linear_of[hf_name] = lin
            self.layers.append(found)
            layer_modules.append(frozenset(h for name in found for h in self.hf_names[name]))
        self.shapes = BaseShapes(modules, layer_modules)
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # content hash -> adapter
        # unloaded (or replaced in place) adapters, kept while a request still holds their
        # LoRARequest: their folder may be gone by the time a step needs them again
        self.retired: weakref.WeakKeyDictionary[LoRARequest, LoRAAdapter] = (
            weakref.WeakKeyDictionary()
        )
        # content hash -> (adapter, admitted requests alive under it): evicted or unloaded, its
        # weights stay for them; the requests' finalizers queue their key on _released (any
        # thread, at any time: a deque append, no lock), drained under the lock
        self.pinned: dict[str, tuple[LoRAAdapter, int]] = {}
        self._released: deque[str] = deque()
        self._known: set[str] = set()  # every content hash ever read: a miss is a re-read
        self._lock = threading.Lock()  # load/unload come from the server's threads
        self.slots: list[str | None] = [None] * config.max_loras
        self.slot_scaling = torch.zeros(config.max_loras, dtype=torch.float32, device=device)
        self._warned_slots = self._logged_fallback = False

    # ---- adapters ----------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Loads and checks an adapter (LoRAError naming the file and tensor), keeps it LRU.

        The files are read outside the lock: a load from the server never holds up a step."""
        key = request.content_hash
        with self._lock:
            self._drain_released()
            adapter = self.loaded.get(key) or self.pinned.get(key, (None,))[0]
            if adapter is None and request in self.retired:
                return self.retired[request]  # unloaded: its requests finish on these weights
            reread = adapter is None and key in self._known
        if adapter is None:
            adapter = self._read(request, reread)
        with self._lock:
            self._known.add(key)
            self.loaded[key] = self.loaded.get(key, adapter)
            self.loaded.move_to_end(key)
            while len(self.loaded) > self.max_cpu_loras:
                evicted, _ = self.loaded.popitem(last=False)
                logger.info("LoRA: adapter %s evicted from memory (--max-cpu-loras)", evicted[:12])
            return self.loaded[key]

    def admit(self, request: LoRARequest, holder: object) -> None:
        """A request (`holder`, the engine's Request) is admitted under the adapter: its weights
        are in memory, read back from the folder if --max-cpu-loras evicted them (LoRAError
        naming the missing or changed file: the request is refused), and stay there, pinned,
        while `holder` lives: no step ever needs the folder for it."""
        adapter = self.add(request)
        key = request.content_hash
        with self._lock:
            self._drain_released()
            held, count = self.pinned.get(key, (adapter, 0))
            self.pinned[key] = (held, count + 1)
        weakref.finalize(holder, self._released.append, key)

    def _drain_released(self) -> None:
        """Drops the pins of requests gone since (under the lock)."""
        while self._released:
            key = self._released.popleft()
            adapter, count = self.pinned[key]
            if count > 1:
                self.pinned[key] = (adapter, count - 1)
            else:
                del self.pinned[key]

    def _read(self, request: LoRARequest, reread: bool) -> LoRAAdapter:
        """The adapter from its folder; a re-read (evicted) must find the same files."""
        if not reread:
            return self._load(request)
        why = f"LoRA adapter '{request.name}' was evicted from memory (--max-cpu-loras "
        why += f"{self.max_cpu_loras}) and cannot be read back from {request.path}"
        try:
            if content_hash(request.path) != request.content_hash:
                raise LoRAError(
                    f"{request.path}: its files changed since the adapter was loaded (content "
                    f"hash {request.content_hash[:12]}); reload it to serve the new weights"
                )
            return self._load(request)
        except LoRAError as e:
            raise LoRAError(f"{why}: {e}") from None

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        """Read, checked unsharded, cut to this rank's share (engine/lora/sharding.py)."""
        return shard_adapter(load_adapter(request, self.shapes, self.max_rank), self._linear_of)

    def remove(self, request: LoRARequest) -> None:
        """Drops the loaded copy. The requests already running under it keep its weights (held
        on their LoRARequest until the last one finishes), so they never need its folder
        again: it may be deleted, its slot reused, and they still finish on their adapter."""
        with self._lock:
            adapter = self.loaded.pop(request.content_hash, None)
            adapter = adapter or self.pinned.get(request.content_hash, (None,))[0]
        if adapter is None:  # evicted (--max-cpu-loras): read it now, while the folder exists
            try:
                adapter = self._load(request)
            except LoRAError as e:
                logger.warning("LoRA: unloaded adapter %s unreadable (%s)", request.name, e)
                return
        with self._lock:  # the value holds an equal copy of the key, not the key itself
            self.retired[request] = replace(adapter, request=replace(request))

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, requests, num_scheduled_tokens) -> bool:
        """Sets the per-token adapter index of the step; False (base path) when no request of
        the batch has an adapter."""
        keys = [r.lora_request.content_hash if r.lora_request else None for r in requests]
        distinct = list(dict.fromkeys(k for k in keys if k is not None))
        if not distinct:
            self.batch.set(None, None)
            return False
        if not self._logged_fallback:
            self._logged_fallback = True
            logger.info(
                "LoRA: batches with adapters run the fused decode step where the CPU kernels "
                "take adapters (decode_layers_lora), else the per-layer path; no CUDA graphs"
            )
        slot_of = self._assign_slots(distinct, requests, keys)
        per_req = np.fromiter((slot_of.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        counts = np.fromiter(num_scheduled_tokens, dtype=np.int64, count=len(keys))
        token_slots = torch.from_numpy(np.repeat(per_req, counts)).to(self.device)
        self.batch.set(token_slots, self.slot_scaling, int(per_req.max()) + 1)
        return True

    def fused_step(self, fused):
        """The fused decode step with this step's adapters added after every projection, where
        the backend's step takes them (the CPU kernels' decode_layers_lora); else None: the
        per-layer path."""
        return None if fused is None else _FusedWithLoRA(fused, self)

    def step_tensors(self) -> tuple:
        """decode_layers_lora's adapter arguments for the current step."""
        tensors = []
        for linears in self.layers:
            for name in _PARTS:
                w = linears[name]
                tensors += [w.a_all, w.bt_all]
        b = self.batch
        return tensors, b.token_slots, b.slot_scaling, b.max_rank

    def _assign_slots(self, distinct: list[str], requests, keys) -> dict[str, int]:
        if len(distinct) > len(self.slots):
            self._grow(len(distinct))
        slot_of = {k: i for i, k in enumerate(self.slots) if k in distinct}
        free = [i for i, k in enumerate(self.slots) if k not in slot_of]  # lowest first
        by_key = {k: r.lora_request for r, k in zip(requests, keys) if k is not None}
        for key in distinct:
            if key not in slot_of:
                slot_of[key] = slot = free.pop(0)
                self._write_slot(slot, self.add(by_key[key]))
        return slot_of

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, linears in enumerate(self.layers):
            for name, weights in linears.items():
                hf = self.hf_names[name]
                if len(hf) == 1:  # one adapter over the whole linear (Phi-3's fused ones)
                    parts = _split_fused(adapter.weights.get((layer, hf[0])), weights.part_sizes)
                else:
                    parts = [adapter.weights.get((layer, h)) for h in hf]
                weights.set_slot(slot, parts)
        self.slots[slot] = adapter.request.content_hash
        self.slot_scaling[slot] = adapter.scaling

    def _grow(self, num_slots: int) -> None:
        """More distinct adapters in one step than --max-loras slots: widen the stacks."""
        if not self._warned_slots:
            logger.warning(
                "LoRA: a step has %d distinct adapters, more than --max-loras %d; widening",
                num_slots,
                len(self.slots),
            )
            self._warned_slots = True
        extra = num_slots - len(self.slots)
        for linears in self.layers:
            for weights in linears.values():
                weights.grow(extra)
        self.slots += [None] * extra
        pad = torch.zeros(extra, dtype=self.slot_scaling.dtype, device=self.device)
        self.slot_scaling = torch.cat([self.slot_scaling, pad])
        self.batch.num_slots = num_slots


class _FusedWithLoRA:
    """engine/runner/fused_decode.py's FusedDecode for a step with adapters: it runs where the
    step supports them and every layer has all four projections adapted."""

    def __init__(self, fused, manager: LoRAManager) -> None:
        self.fused, self.manager = fused, manager

    def can_run(self, meta) -> bool:
        full = all(len(linears) == len(_PARTS) for linears in self.manager.layers)
        return full and self.fused.supports_lora(meta)

    def run(self, input_ids, positions, meta, kv_caches):
        lora = self.manager.step_tensors()
        return self.fused.run(input_ids, positions, meta, kv_caches, lora=lora)
