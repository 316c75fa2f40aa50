"""Llama-family decoder (Llama, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings.

Runs one flattened batch of tokens from many sequences (no padding); attention goes through a
paged-KV backend from kernels/. Numerics follow Hugging Face's implementation op for op so that
float32 greedy decoding matches transformers token for token. The layers (engine/layers/) pick
their fast paths at load; this file only composes them.

Module names follow Hugging Face's (model.embed_tokens, model.layers[i].self_attn / .mlp /
.input_layernorm / .post_attention_layernorm, model.norm, lm_head); engine/fused_decode.py reads
that layout.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import (
    Attention,
    KVCache,
    Linear,
    RMSNorm,
    SiluAndMul,
    rope_from_config,
)
from kernels import AttentionBackend, AttentionMetadata


class LlamaAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = getattr(cfg, "attention_bias", False)
        h, d = cfg.hidden_size, self.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # One GEMM for q, k and v (loaded from HF's q_proj/k_proj/v_proj, see load_weights).
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, self.scale, backend)

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate(q, k)
        return self.o_proj(self.attn(q, k, v, meta, kv_cache))


class LlamaMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        # gate and up in one GEMM (loaded from HF's gate_proj/up_proj, see load_weights).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, h]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, meta, kv_cache):
        """x: the previous layer's MLP output, residual: the stream before it (None at first)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = rope_from_config(cfg, head_dim)  # raises for an unsupported scaling
        self.model = LlamaModel(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, meta.max_seq_len, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Loads Hugging Face names, stacking q/k/v and gate/up into the fused projections.

        Returns (missing, unexpected) names in HF's naming, as load_state_dict would.
        """
        state = dict(state)
        tied = getattr(self.config, "tie_word_embeddings", False)
        if "lm_head.weight" not in state and tied and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing: list[str] = []
        for prefix, fused, parts in _fused_params(len(self.model.layers), state):
            got = [state.pop(f"{prefix}.{p}", None) for p in parts]
            if any(g is None for g in got):
                missing += [f"{prefix}.{p}" for p, g in zip(parts, got) if g is None]
                continue
            state[f"{prefix}.{fused}"] = torch.cat(got, dim=0)
        result = self.load_state_dict(state, strict=False)
        missing += [m for m in result.missing_keys if not m.startswith("rotary.")]
        return missing, list(result.unexpected_keys)


def _fused_params(num_layers: int, state: dict[str, torch.Tensor]):
    """(module prefix, fused param name, HF param names stacked into it in order)."""
    for i in range(num_layers):
        for kind in ("weight", "bias"):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            qkv = [f"{p}_proj.{kind}" for p in "qkv"]
            if kind == "weight" or f"{attn}.q_proj.bias" in state:
                yield attn, f"qkv_proj.{kind}", qkv
            if kind == "weight" or f"{mlp}.gate_proj.bias" in state:
                yield mlp, f"gate_up_proj.{kind}", [f"gate_proj.{kind}", f"up_proj.{kind}"]
