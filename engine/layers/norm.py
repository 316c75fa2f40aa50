"""RMSNorm, alone or fused with the residual add, over the last dimension of any shape (so the
same layer serves per-head q/k norms on [T, H, D])."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.base import KernelLayer


class RMSNorm(KernelLayer):
    """norm(x), or with a residual: residual = x + residual, then norm(residual).

    Numerics follow Hugging Face: normalize in float32, round to x's dtype, then scale by the
    weight. The CPU kernel writes both results of the fused form in place in one pass.
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        """unit_offset: scale by (1 + weight) in float32 before rounding, as Gemma does (its
        weights are stored as offsets from 1 and initialised to 0)."""
        super().__init__()
        self.unit_offset = unit_offset
        init = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size))
        self.eps = eps
        self.kernel_weight: torch.Tensor | None = None  # what the CPU kernel scales by

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def select(self, ops) -> None:
        super().select(ops)
        weight = self.weight.detach()
        # The kernel scales by one tensor: (1 + weight) rounded once to the weight's dtype.
        self.kernel_weight = (1.0 + weight.float()).to(weight.dtype) if self.unit_offset else weight

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if x.dim() != 2:  # per-head use: the kernel takes rows of [N, hidden]
                rows = x.reshape(-1, x.shape[-1])
                out = torch.empty_like(rows)
                self.ops.rms_norm(out, rows, self.kernel_weight, self.eps)
                return out.view(x.shape)
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, self.kernel_weight, self.eps)
            return out
        self.ops.fused_add_rms_norm(x, residual, self.kernel_weight, self.eps)
        return x, residual
