"""bf16 linears on CPU with weights packed once at load: engine/layers/linear.py's CPU path.

torch's F.linear repacks the weight on every call; a pre-packed weight skips that. Prefill-sized
calls go to oneDNN with a weight packed for many rows. Decode-sized calls (up to AMX_MAX_ROWS)
go to our kernel (pagedserve_kernels/csrc/linear.cpp, dense_linear), which streams the weight once:
on AMX tiles where the CPU has AMX, else on AVX-512 BF16 vectors (the same packed weight); otherwise
(neither) to oneDNN with a packing tuned for few rows. Narrow linears (at most
AMX_NARROW_MAX_OUT outputs) take the AMX kernel at every row count, as it splits the output
columns over all threads (not the vector body: measured on AMX only). The row and width
thresholds come from measurements: bench/README.md
("Narrow linears") and bench/micro/cpu_ab.py rerun them. Same math as F.linear: bf16 inputs, float32
accumulation, the bias added in float32, one rounding to bf16.

oneDNN builds (JIT-compiles) and caches a kernel for every distinct row count it meets, about
0.6 MiB each (ideep's and oneDNN's caches, 1024 entries apiece), so prefill chunks of every
length made memory grow for thousands of requests: oneDNN calls run on rows padded up to one of
a few sizes per doubling (onednn_rows()), which bounds both caches and the compiling, for at
most 1/8 more rows past 128 (exact against padded: bench/results/HISTORY.md, "Experiments
retired in the house issue (2026-12-04)", "oneDNN row padding").

Batch invariance (pagedserve_kernels.cpu_ops.batch_invariant()): our kernel takes every call, so a
row's result is the same bits at any row count (both bodies run each row's K loop alone; oneDNN
picks its blocking by M).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve_kernels.cpu_ops import batch_invariant

DECODE_ROWS = 32  # packing hint for decode-sized batches
PREFILL_ROWS = 2048  # packing hint for prefill chunks
SMALL_MAX_ROWS = 96  # row counts up to this use oneDNN's decode packing
AMX_MAX_ROWS = 32  # row counts up to this use the AMX kernel, where it runs
# Outputs up to this wide use the AMX kernel at every row count (bench/README.md, "Narrow linears").
AMX_NARROW_MAX_OUT = 1024
# oneDNN row counts above this are multiples of it (onednn_rows)
ONEDNN_MIN_ROW_STEP = 16


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """linear: an nn.Linear or engine.layers.Linear (weight [out, in], bias or None).
    ops: pagedserve_kernels.cpu_ops, whose dense_linear then takes the calls it fits, or None."""

    def __init__(self, linear: nn.Module, ops=None, small: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().to(w.dtype)
        self.large = torch.ops.mkldnn._reorder_linear_weight(w, PREFILL_ROWS)
        self.ops = ops if _amx_fits(ops, w) else None
        # dense_linear's packing, AMX's B-tile layout (ops.decode_layers reads it too)
        self.amx: torch.Tensor | None = None
        self.kernel = "onednn" if self.ops is None else self.ops.dense_linear_kernel()
        # every row count to our kernel: a row's bits then do not depend on the batch
        self.amx_max_rows = AMX_MAX_ROWS
        self.narrow = self.kernel == "amx" and self.out_features <= AMX_NARROW_MAX_OUT
        if self.ops is not None:
            self.amx = self.ops.amx_pack_weight(w)
            if batch_invariant():
                self.amx_max_rows = 1 << 62
        else:  # small=False: only prefill-sized calls come (GGUF --gguf-weights auto)
            self.small = torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS) if small else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        rows = x.shape[0]
        if self.ops is not None and (rows <= self.amx_max_rows or self.narrow):
            out = x.new_empty(rows, self.out_features)
            x = x if x.stride(-1) == 1 else x.contiguous()
            self.ops.dense_linear(out, x, self.amx, self.bias)
            return out
        small = self.ops is None and rows <= SMALL_MAX_ROWS and self.small is not None
        packed = self.small if small else self.large
        padded = onednn_rows(rows)
        if padded != rows:  # a cached row count: the pad rows' outputs are dropped
            x_pad = x.new_empty(padded, x.shape[1])
            x_pad[:rows] = x
            x_pad[rows:] = 0
            x = x_pad
        return onednn_linear(x, packed, self.bias)[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call runs at: rows itself up to ONEDNN_MIN_ROW_STEP (decode
    batches, whose cost is the weight's reading), above it rounded up to a multiple of that, and
    past 128 to a multiple of an eighth of the power of two below: at most 8 sizes per doubling,
    so oneDNN's per-shape caches stay bounded (39 sizes up to 512 rows), for at most 1/8 more
    rows past 128."""
    if rows <= ONEDNN_MIN_ROW_STEP:
        return rows
    step = max(ONEDNN_MIN_ROW_STEP, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """oneDNN's linear over a weight packed by _reorder_linear_weight (the tests count its row
    counts through this name)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _amx_fits(ops, w: torch.Tensor) -> bool:
    """dense_linear runs here (AMX or AVX-512 BF16) and w fits amx_pack_weight's layout."""
    n, k = w.shape
    return ops is not None and ops.dense_linear_kernel() != "" and n % 16 == 0 and k % 32 == 0


def pack_linears(model: nn.Module, ops=None) -> int:
    """Swaps every nn.Linear in model for a PackedLinear; returns how many.

    ops: pagedserve_kernels.cpu_ops (its AMX kernel takes decode-sized calls), or None.
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, ops))
    return len(swaps)
