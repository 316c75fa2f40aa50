"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse MoE block in place of the MLP on the
layers decoder_sparse_step and mlp_only_layers select: a softmax top-k router (`gate`),
renormalised when norm_topk_prob, over SwiGLU experts (engine/layers/experts.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import Experts, Linear
from engine.layers.experts import route_top_k
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, bool(cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        weights, ids = route_top_k(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, ids, weights)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg, layer_idx: int) -> nn.Module:
        sparse = cfg.num_experts > 0 and (layer_idx + 1) % cfg.decoder_sparse_step == 0
        if sparse and layer_idx not in (cfg.mlp_only_layers or []):
            return Qwen3MoeSparseMoeBlock(cfg)
        return LlamaMLP(cfg)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer

    def rename_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """experts.{e}.gate_proj/up_proj/down_proj.weight -> stacked experts.gate_up_proj and
        experts.down_proj (an expert with a tensor missing is reported by name)."""
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                continue
            prefix = f"model.layers.{i}.mlp.experts"
            if f"{prefix}.gate_up_proj" in state:
                continue  # already stacked (transformers 5's in-memory layout)
            names = [
                [f"{prefix}.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
                for e in range(layer.mlp.experts.num_experts)
            ]
            if not all(n in state for expert in names for n in expert):
                continue  # load_state_dict reports the stacked names as missing
            parts = [[state.pop(n) for n in expert] for expert in names]
            state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(p[:2]) for p in parts])
            state[f"{prefix}.down_proj"] = torch.stack([p[2] for p in parts])
        return state
