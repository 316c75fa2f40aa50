"""Gemma 2: Llama's attention and a gated MLP, with Gemma's differences.

- RMSNorm scales by (1 + weight) in float32, and each layer has four norms: before and after
  attention, before and after the MLP (the "sandwich"); the residual adds the post-norms' output.
- Embeddings are scaled by sqrt(hidden_size), rounded to the embedding dtype first.
- Attention scale query_pre_attn_scalar ** -0.5; attention logits soft-capped by
  attn_logit_softcapping; final logits by final_logit_softcapping.
- gelu_pytorch_tanh(gate) * up in the MLP; tied embeddings.
- Local (sliding_window) and global layers interleave as layer_types says.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import Attention, GeluAndMul, RMSNorm, layer_windows
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedserve_kernels import AttentionBackend, AttentionMetadata


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__(cfg, backend)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, backend, window, softcap
        )


class GemmaMLP(LlamaMLP):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.act_fn = GeluAndMul()


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[GemmaAttention] = GemmaAttention

    def __init__(self, cfg, backend: AttentionBackend, layer_idx: int = 0) -> None:
        super().__init__()
        self.is_sliding = layer_windows(cfg)[layer_idx] > 0
        self.self_attn = self.attention_cls(cfg, backend, layer_windows(cfg)[layer_idx])
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, x, residual, rope, meta, kv_cache):
        """x: the previous layer's post-MLP-normed output, residual: the stream before it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)  # residual = x + residual first
        x = self.post_attention_layernorm(self.self_attn(x, rope, meta, kv_cache))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.final_logit_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.model.embed_tokens(input_ids)
        # as Hugging Face: sqrt(hidden) in float32, rounded to the embedding dtype
        return x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed(input_ids)
        ropes = self.layer_ropes(positions, meta.max_seq_len, x.dtype)
        residual = None
        for layer, rope, kv_cache in zip(self.model.layers, ropes, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    def layer_ropes(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> list:
        """Each layer's prepared rotary tables: Gemma 2's layers all share one base."""
        return [self.rotary.prepare(positions, max_seq_len, dtype)] * len(self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        logits = self.lm_head.logits(hidden)  # every rank's vocabulary shard, gathered
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
