"""Mixture-of-experts layer: a softmax top-k router and SwiGLU experts that each run only on the
tokens routed to them.

Weights are stacked per layer as transformers 5 holds them: gate_up_proj [E, 2I, H] (gate rows
first) and down_proj [E, H, I]; checkpoints that store experts.{e}.gate_proj/up_proj/down_proj
are stacked at load (engine/models/qwen3_moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.base import NATIVE, KernelLayer


def route_top_k(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over all experts in float32, the top_k of them, optionally renormalised to sum 1;
    returns (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class Experts(KernelLayer):
    """out[t] = sum over t's experts e of weight[t, e] * down_e(silu(gate_e x) * up_e x)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def choose(self, ops) -> str:
        return NATIVE  # no expert kernel yet: the oracle runs on every device

    def forward_native(
        self,
        x: torch.Tensor,  # [T, H]
        expert_ids: torch.Tensor,  # [T, k]
        weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        out = torch.zeros_like(x)
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue  # an expert no token chose this step costs nothing
            tokens, slot = torch.where(expert_ids == e)
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # [n_e, H]
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        return out
