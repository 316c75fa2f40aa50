"""Mixture-of-experts layer: a softmax top-k router and SwiGLU experts that each run only on the
tokens routed to them.

Weights are stacked per layer as transformers 5 holds them: gate_up_proj [E, 2I, H] (gate rows
first) and down_proj [E, H, I]; checkpoints that store experts.{e}.gate_proj/up_proj/down_proj
are stacked at load (engine/models/qwen3_moe.py). Under tensor parallelism every rank holds
every expert with its share of the intermediate size (gate/up rows, down columns) and one
all-reduce sums the partial outputs, as a row-parallel linear does.

On CPU in bf16 with the C++ kernels (AMX) the experts bind to pagedserve_kernels/csrc/experts.cpp:
every expert's weights packed once at select() (amx_pack_weight, the unpacked copies dropped) and
one moe_experts call per layer and step that runs only the experts with routed rows, with the
oracle's grouping and its rounding of each weighted term and each add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, get_tp
from engine.layers.base import CPU, NATIVE, KernelLayer
from engine.layers.linear import rank_rows, shard_size


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
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.num_experts = num_experts
        e, h = num_experts, hidden_size
        i = shard_size(intermediate_size, tp.world_size, "moe_intermediate_size")
        self.intermediate_size = i  # this rank's
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def choose(self, ops) -> str:
        w = self.gate_up_proj
        fits = self.intermediate_size % 32 == 0 and w.shape[2] % 32 == 0  # amx_pack_weight's
        if ops is None or w.device.type != "cpu" or w.dtype != torch.bfloat16 or not fits:
            return NATIVE
        return CPU if ops.amx_available() else NATIVE

    def select(self, ops) -> None:
        super().select(ops)
        if self.impl == CPU:
            pack = self.ops.amx_pack_weight
            self.packed_gate_up = torch.stack([pack(w) for w in self.gate_up_proj.detach()])
            self.packed_down = torch.stack([pack(w) for w in self.down_proj.detach()])
            self.gate_up_proj, self.down_proj = None, None  # the packed copies replace them

    def forward_cpu(
        self,
        x: torch.Tensor,  # [T, H]
        expert_ids: torch.Tensor,  # [T, k]
        weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        x = x.contiguous()
        out = torch.empty_like(x)
        self.ops.moe_experts(
            out, x, expert_ids.contiguous(), weights.float().contiguous(),
            self.packed_gate_up, self.packed_down,
        )
        return all_reduce(out)

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
        return all_reduce(out)

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        """This rank's intermediate rows of one expert's gate_proj/up_proj (part) or columns of
        its down_proj, or of the stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I] (leaf)."""
        n, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if part in ("gate_proj", "up_proj"):
            return rank_rows(sl, start, n)
        if part == "down_proj":
            return rank_rows(sl, start, n, dim=1)
        if leaf == "down_proj":
            return rank_rows(sl, start, n, dim=2)
        half = sl.get_shape()[1] // 2
        gate, up = rank_rows(sl, start, n, dim=1), rank_rows(sl, half + start, n, dim=1)
        return torch.cat([gate, up], dim=1)
