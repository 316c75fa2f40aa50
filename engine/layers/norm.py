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

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if x.dim() != 2:  # per-head use: the kernel takes rows of [N, hidden]
                rows = x.reshape(-1, x.shape[-1])
                out = torch.empty_like(rows)
                self.ops.rms_norm(out, rows, self.weight, self.eps)
                return out.view(x.shape)
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, self.weight, self.eps)
            return out
        self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual
