"""Linear with optional bias. Its CPU implementation is the packed bf16 linear of
pagedserve_kernels/cpu_linear.py (oneDNN packing, and the AMX kernel where the C++ kernels
loaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, get_tp
from engine.layers.base import CPU, NATIVE, KernelLayer
from engine.layers.quantization.gguf import select_gguf
from engine.layers.quantization.int8 import select_int8
from pagedserve_kernels.cpu_linear import PackedLinear, can_pack

PACKED = "packed"  # oneDNN-packed weights without the C++ kernels (they did not load)


class Linear(KernelLayer):
    """y = x W^T + b with W [out, in], the parameter names of nn.Linear (weights load as is).

    On CPU in bf16 the weight is packed once at select() and the unpacked copy is dropped, so
    only forward runs afterwards (forward_native needs the weight). A Linear marked for a
    quantization (engine/layers/quantization/apply.py) binds to its quantized weights.
    """

    quantization: str | None = None  # "int8" once marked: select() quantizes instead of packing

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedLinear | None = None
        nn.Linear.reset_parameters(self)  # nn.Linear's init: the same draws from the seeded RNG

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def choose(self, ops) -> str:
        if not can_pack(self.weight.device, self.weight.dtype):
            return NATIVE
        return CPU if ops is not None else PACKED

    def select(self, ops) -> None:
        if self.quantization == "gguf":
            return select_gguf(self, ops)
        if self.quantization is not None:
            return select_int8(self, ops)
        self.impl = self.choose(ops)
        self.ops = ops if self.impl == CPU else None
        if self.impl != NATIVE:
            self.packed = PackedLinear(self, self.ops)
            # the packed copies replace the weight (a tied one stays with its other owner)
            self.weight, self.bias = None, None
        self.bind(self.impl)

    def bind(self, impl: str) -> None:
        self.forward = self.forward_native if impl == NATIVE else self.packed.forward

    @property
    def kernel_weight(self) -> torch.Tensor | None:
        """The weight as the C++ kernels packed it (AMX), or None where they do not take it."""
        return None if self.packed is None else self.packed.amx

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.impl}"


# ---- tensor-parallel linears (engine/distributed.py holds the rank) ---
def rank_rows(sl, start: int, size: int, dim: int = 0) -> torch.Tensor:
    """Rows [start, start + size) along `dim` of a safetensors slice (only they are read)."""
    index = [slice(None)] * len(sl.get_shape())
    index[dim] = slice(start, start + size)
    return sl[tuple(index)]


def shard_size(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} ({total}) does not divide by tensor_parallel_size {world_size}")
    return total // world_size


class ColumnParallelLinear(Linear):
    """Output features split over the ranks (W rows [rank * n, (rank + 1) * n)); no collective:
    the next layer takes the shard (a row-parallel linear) or the caller gathers it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(in_features, shard_size(out_features, tp.world_size, "output size"), bias)

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        n = sl.get_shape()[0] // self.tp_size
        return rank_rows(sl, self.tp_rank * n, n)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up (HF's gate_proj, up_proj) in one GEMM, each split over the ranks on its own,
    so a rank holds [its gate rows; its up rows]."""

    def __init__(self, in_features: int, part_size: int, bias: bool = False) -> None:
        super().__init__(in_features, 2 * part_size, bias)
        self.part_size = part_size // self.tp_size  # per rank

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        if part is not None:  # gate_proj or up_proj
            return super().load_shard(leaf, part, sl)
        half = sl.get_shape()[0] // 2  # stored fused (Phi-3): each half split on its own
        n = half // self.tp_size
        start = self.tp_rank * n
        return torch.cat([rank_rows(sl, start, n), rank_rows(sl, half + start, n)])


class QKVParallelLinear(Linear):
    """q, k, v in one GEMM; a rank holds its query heads and its KV heads. With fewer KV heads
    than ranks each KV head is replicated on tensor_parallel_size / num_kv_heads ranks.

    num_heads, num_kv_heads, q_size, kv_size: this rank's.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.head_dim = head_dim
        self.num_heads = shard_size(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = shard_size(num_kv_heads, tp.world_size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:  # replicated: tensor_parallel_size must be a multiple of num_key_value_heads
            if tp.world_size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {tp.world_size} is not a multiple of "
                    f"num_key_value_heads ({num_kv_heads})"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.world_size // num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        d = self.head_dim
        q_rows = (self.tp_rank * self.q_size, self.q_size)
        kv_rows = (self.kv_head_start * d, self.kv_size)
        if part == "q":
            return rank_rows(sl, *q_rows)
        if part in ("k", "v"):
            return rank_rows(sl, *kv_rows)
        # stored fused (Phi-3): [all q; all k; all v]
        q_total, kv_total = self.total_num_heads * d, self.total_num_kv_heads * d
        return torch.cat(
            [
                rank_rows(sl, *q_rows),
                rank_rows(sl, q_total + kv_rows[0], kv_rows[1]),
                rank_rows(sl, q_total + kv_total + kv_rows[0], kv_rows[1]),
            ]
        )


class RowParallelLinear(Linear):
    """Input features split over the ranks (W columns); the partial products are summed with one
    all-reduce. Only rank 0 holds the bias (the others load zeros), so it is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(shard_size(in_features, tp.world_size, "input size"), out_features, bias)

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        if leaf == "bias":
            full = sl[:]
            return full if self.tp_rank == 0 else torch.zeros_like(full)
        n = sl.get_shape()[1] // self.tp_size
        return rank_rows(sl, self.tp_rank * n, n, dim=1)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias))

    def bind(self, impl: str) -> None:
        super().bind(impl)
        if impl != NATIVE and self.tp_size > 1:
            packed = self.packed.forward
            self.forward = lambda x: all_reduce(packed(x))
