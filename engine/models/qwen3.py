"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE, and head_dim set apart from
hidden_size / num_attention_heads (the config's head_dim)."""

from __future__ import annotations

import torch

from engine.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg, backend) -> None:
        super().__init__(cfg, backend)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # over head_dim of [T, H, D] and [T, Hkv, D]


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
