"""Tensor-parallel process state and the collectives the sharded layers call (torch.distributed).

Each rank is one worker process (engine/executor/worker.py); init_distributed() runs once in it,
before the model is built, so the parallel layers size their shards at construction (vLLM's
parallel_state idea: a model file never sees the rank). With one rank every collective is the
identity and nothing is initialised, so the layers have a single code path.

Two groups: `device_group` (NCCL on CUDA, gloo on CPU) carries the layers' all-reduces and
gathers; `cpu_group` (always gloo) carries the engine's messages, one broadcast per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    device_group: object = None
    cpu_group: object = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the engine; the others only run the forward."""
        return self.rank == 0


_STATE = ParallelState()


class CollectiveTimer:
    """Seconds spent inside collectives since the last take(), for the step's share of them."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


collective_timer = CollectiveTimer()


def get_tp() -> ParallelState:
    return _STATE


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device_type: str,
    timeout_s: float = 600.0,
) -> ParallelState:
    """Joins the TCP rendezvous at master_addr:master_port (every rank, every host) and sets the
    process's state. A no-op state at world size 1."""
    global _STATE
    if world_size == 1:
        _STATE = ParallelState()
        return _STATE
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _STATE = ParallelState(rank, world_size, dist.group.WORLD, cpu_group)
    return _STATE


def destroy_distributed() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (the row-parallel linears' and the vocab embedding's)."""
    state = _STATE
    if state.world_size == 1:
        return x
    start = time.perf_counter()
    dist.all_reduce(x, group=state.device_group)
    collective_timer.seconds += time.perf_counter() - start
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:  # [..., n] -> [..., n * world_size]
    """Every rank's shard side by side in rank order (the vocab-parallel lm_head's logits)."""
    state = _STATE
    if state.world_size == 1:
        return x
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=state.device_group)
    collective_timer.seconds += time.perf_counter() - start
    return torch.cat(parts, dim=-1)


def min_across_ranks(value: int) -> int:
    """The smallest value any rank holds (KV blocks: every rank must agree on one pool)."""
    state = _STATE
    if state.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())


def barrier() -> None:
    """Every rank got here (the shutdown: rank 0 must not exit before the others read it)."""
    if _STATE.world_size > 1:
        dist.barrier(group=_STATE.cpu_group)


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0's payload on every rank: its length, then its bytes (two gloo broadcasts)."""
    state = _STATE
    if state.world_size == 1:
        assert payload is not None
        return payload
    start = time.perf_counter()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=state.cpu_group)
    if state.is_driver:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=state.cpu_group)
    collective_timer.seconds += time.perf_counter() - start
    return payload if state.is_driver else buf.numpy().tobytes()


def check_tensor_parallel(hf_config, world_size: int) -> None:
    """Start-up check, before any process starts: ValueError naming every size of the config
    that does not split over `world_size` ranks."""
    if world_size == 1:
        return
    problems = []
    for name in ("num_attention_heads", "vocab_size", "intermediate_size", "moe_intermediate_size"):
        value = getattr(hf_config, name, None)
        if name == "moe_intermediate_size" and not getattr(hf_config, "num_experts", 0):
            continue
        if value is not None and value % world_size:
            problems.append(f"{name} ({value})")
    kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if (kv % world_size) if kv >= world_size else (world_size % kv):
        problems.append(f"num_key_value_heads ({kv}; fewer than the ranks must divide them)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide " + ", ".join(problems)
        )
