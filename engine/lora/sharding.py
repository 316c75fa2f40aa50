"""LoRA adapters under tensor parallelism: each rank keeps the slices of A and B that match its
shard of the base linear, so the adapter's contribution is exact with the layers' own layout.

    column-parallel (q/k/v, gate/up: output rows split)   B: this rank's output rows, A whole
        y_rank = x W_rank^T + s (x A^T) B_rank^T
    row-parallel (o, down: input columns split, one all-reduce)   A: this rank's input columns,
    B whole, the contribution added to the partial product BEFORE the all-reduce
        y = sum_ranks [x_rank W_rank^T + s (x_rank A_rank^T) B^T] = x W^T + s (x A^T) B^T

No extra collective: the row-parallel shrink is summed by the all-reduce the layer already does.
The q rows follow the rank's query heads and the k/v rows its KV heads (a replicated KV head,
tensor_parallel_size > num_key_value_heads, gives its whole rows to every rank that holds it).
Adapters are checked against the full (unsharded) shapes, then sliced once at load: a rank holds
only its share in memory. At one rank every function here is the identity.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.distributed import all_reduce
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.lora import LoRALinearWeights, wrap_lora
from engine.lora.adapter import LoRAAdapter


def _tp(lin: nn.Module) -> int:
    return getattr(lin, "tp_size", 1)


def full_shape(hf_module: str, lin: nn.Module, part_size: int) -> tuple[int, int]:
    """(in_features, out_features) of the HF module across all ranks (what a PEFT adapter
    holds), from the rank's linear and the part's size at this rank."""
    tp = _tp(lin)
    if tp == 1:
        return lin.in_features, part_size
    if isinstance(lin, RowParallelLinear):
        return lin.in_features * tp, part_size
    if hf_module in _FUSED:
        return lin.in_features, sum(n for _, n in _fused_parts(hf_module, lin))
    if isinstance(lin, QKVParallelLinear):
        heads = lin.total_num_heads if hf_module == "q_proj" else lin.total_num_kv_heads
        return lin.in_features, heads * lin.head_dim
    return lin.in_features, part_size * tp


_FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's fused HF modules: one pair over several parts


def _fused_parts(hf_module: str, lin: nn.Module) -> tuple[tuple[str, int], ...]:
    """The parts a fused HF module's B stacks, with their full (all-rank) row counts."""
    if hf_module == "qkv_proj":
        q, kv = lin.total_num_heads * lin.head_dim, lin.total_num_kv_heads * lin.head_dim
        return (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
    n = lin.part_size * _tp(lin)
    return (("gate_proj", n), ("up_proj", n))


def shard_pair(
    hf_module: str, lin: nn.Module, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [r, in], B [out, r]) of a full adapter pair on `lin`'s shard."""
    tp = _tp(lin)
    if tp == 1:
        return a, b
    rank = lin.tp_rank
    if hf_module in _FUSED:  # each part's rows cut as its own module's, stacked again
        parts = _fused_parts(hf_module, lin)
        rows = b.split([n for _, n in parts])
        return a, torch.cat([shard_pair(p, lin, a, r)[1] for (p, _), r in zip(parts, rows)])
    if isinstance(lin, RowParallelLinear):
        n = lin.in_features
        return a[:, rank * n : (rank + 1) * n].contiguous(), b
    if isinstance(lin, QKVParallelLinear):
        if hf_module == "q_proj":
            start, size = rank * lin.q_size, lin.q_size
        else:
            start, size = lin.kv_head_start * lin.head_dim, lin.kv_size
        return a, b[start : start + size].contiguous()
    if isinstance(lin, MergedColumnParallelLinear):
        n = lin.part_size
    elif isinstance(lin, ColumnParallelLinear):
        n = lin.out_features
    else:
        raise ValueError(f"LoRA on {hf_module}: {type(lin).__name__} has no sharding rule")
    return a, b[rank * n : (rank + 1) * n].contiguous()


def shard_adapter(adapter: LoRAAdapter, linear_of: dict[str, nn.Module]) -> LoRAAdapter:
    """The adapter with every pair cut to this rank's share (the same object at one rank)."""
    if all(_tp(lin) == 1 for lin in linear_of.values()):
        return adapter
    weights = {
        (layer, hf): shard_pair(hf, linear_of[hf], a, b)
        for (layer, hf), (a, b) in adapter.weights.items()
    }
    return replace(adapter, weights=weights)


def _local_forward(lin: RowParallelLinear):
    """The row-parallel linear's partial product, without its all-reduce."""
    if lin.packed is not None:
        return lin.packed.forward
    return lambda x: torch.nn.functional.linear(x, lin.weight, lin.bias)


def wrap(lin: nn.Module, weights: LoRALinearWeights) -> None:
    """engine/layers/lora.py's wrap_lora, except on a row-parallel linear above one rank: there
    the adapters' contribution joins the partial product before the layer's all-reduce."""
    if not (isinstance(lin, RowParallelLinear) and lin.tp_size > 1):
        wrap_lora(lin, weights)
        return
    local, batch = _local_forward(lin), weights.batch
    lin.lora = weights

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = local(x)
        return all_reduce(weights.add_to(y, x) if batch.active else y)

    lin.forward = forward
