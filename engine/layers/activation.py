"""SiLU-and-mul: silu(gate) * up over a fused [T, 2I] gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.base import KernelLayer


class SiluAndMul(KernelLayer):
    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[-1] // 2)
        self.ops.silu_and_mul(out, gate_up)
        return out
