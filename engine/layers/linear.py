"""Linear with optional bias. Its CPU implementation is the packed bf16 linear of
kernels/cpu_linear.py (oneDNN packing, and the AMX kernel where the C++ kernels loaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.base import CPU, NATIVE, KernelLayer
from engine.layers.quantization import select_quantized
from kernels.cpu_linear import PackedLinear, can_pack

PACKED = "packed"  # oneDNN-packed weights without the C++ kernels (they did not load)


class Linear(KernelLayer):
    """y = x W^T + b with W [out, in], the parameter names of nn.Linear (weights load as is).

    On CPU in bf16 the weight is packed once at select() and the unpacked copy is dropped, so
    only forward runs afterwards (forward_native needs the weight). A Linear marked for a
    quantization (engine/layers/quantization.py, mark_quantized) binds to its quantized weights.
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
        if self.quantization is not None:
            return select_quantized(self, ops)
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
