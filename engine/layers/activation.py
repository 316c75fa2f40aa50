"""Gated activations over a fused [T, 2I] gate|up projection: silu(gate) * up (Llama) and
gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.base import NATIVE, KernelLayer


class SiluAndMul(KernelLayer):
    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[-1] // 2)
        self.ops.silu_and_mul(out, gate_up)
        return out


class GeluAndMul(KernelLayer):
    """gelu(gate, tanh approximation) * up; no CPU kernel yet, so the oracle runs everywhere."""

    def choose(self, ops) -> str:
        return NATIVE

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
