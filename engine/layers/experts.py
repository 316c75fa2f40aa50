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
        t, k = expert_ids.shape
        # one gather of the routed rows, grouped by expert (a stable sort keeps token order)
        order = torch.argsort(expert_ids.flatten(), stable=True)  # [T*k] pair ids
        rows = x[order // k]  # [T*k, H]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        ys, start = torch.empty_like(rows), 0
        for e, count in enumerate(counts):
            if count == 0:
                continue  # an expert no token chose this step costs nothing
            seg = slice(start, start + count)
            gate, up = F.linear(rows[seg], self.gate_up_proj[e]).chunk(2, dim=-1)
            ys[seg] = F.linear(F.silu(gate) * up, self.down_proj[e])  # [n_e, H]
            start += count
        weighted = (ys * weights.flatten()[order, None]).to(x.dtype)
        pairs = torch.empty_like(weighted)
        pairs[order] = weighted  # back to [T*k] pair order
        # each token's terms added in ascending expert order, one rounding per add: the sums a
        # per-expert index_add_ (transformers' order) makes, without its slow scatter
        by_expert = expert_ids.argsort(dim=-1, stable=True)  # [T, k]
        pairs = pairs.view(t, k, -1).gather(1, by_expert[..., None].expand(-1, -1, x.shape[1]))
        out = pairs[:, 0].clone() if k else torch.zeros_like(x)
        for j in range(1, k):
            out += pairs[:, j]
        return out
