"""Llama-family decoder (Llama, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings.

Runs one flattened batch of tokens from many sequences (no padding); attention goes through a
paged-KV backend from pagedserve_kernels/. Numerics follow Hugging Face's implementation op for op
so that float32 greedy decoding matches transformers token for token. The layers (engine/layers/)
pick their fast paths at load; this file only composes them.

Module names follow Hugging Face's (model.embed_tokens, model.layers[i].self_attn / .mlp /
.input_layernorm / .post_attention_layernorm, model.norm, lm_head); engine/runner/fused_decode.py
reads that layout.
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
    layer_windows,
    rope_from_config,
)
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve_kernels import AttentionBackend, AttentionMetadata


class LlamaAttention(nn.Module):
    """Head counts are this rank's under tensor parallelism (QKVParallelLinear splits them)."""

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.scale = self.head_dim**-0.5
        qkv_bias, o_bias = self.biases(cfg)
        h, d = cfg.hidden_size, self.head_dim
        # One GEMM for q, k and v (loaded from HF's q_proj/k_proj/v_proj, see load_weights).
        self.qkv_proj = QKVParallelLinear(
            h, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias=qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, bias=o_bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, self.scale, backend)

    def biases(self, cfg) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Llama's attention_bias sets both."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k normalisation before RoPE: none in Llama (Qwen3 has one)."""
        return q, k

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate(*self.norm_qk(q, k))
        return self.o_proj(self.attn(q, k, v, meta, kv_cache))


class LlamaMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        # gate and up in one GEMM (loaded from HF's gate_proj/up_proj, see load_weights).
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, bias=bias
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, h]


class LlamaDecoderLayer(nn.Module):
    """Families swap the attention or MLP class (attention_cls, mlp_cls) and keep the rest."""

    attention_cls: type[nn.Module] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, cfg, backend: AttentionBackend, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, backend)
        self.mlp = self.make_mlp(cfg, layer_idx)
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

    def make_mlp(self, cfg, layer_idx: int) -> nn.Module:
        return self.mlp_cls(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(cfg, backend, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = rope_from_config(cfg, head_dim_of(cfg))  # raises for an unsupported scaling
        self.model = LlamaModel(cfg, backend, self.decoder_layer_cls)
        for layer, window in zip(self.model.layers, layer_windows(cfg)):
            if isinstance(getattr(layer.self_attn, "attn", None), Attention):
                layer.self_attn.attn.window = window  # Mistral, Qwen2/3 with sliding windows
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: images merged in (LLaVA)
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.prepare(positions, meta.max_seq_len, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        """ValueError for what the config asks and this implementation does not do."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        return self.lm_head.logits(hidden).float()  # every rank's vocabulary shard, gathered

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Loads Hugging Face names, stacking q/k/v and gate/up into the fused projections.

        Returns (missing, unexpected) names in HF's naming, as load_state_dict would.
        """
        state = dict(state)
        tied = getattr(self.config, "tie_word_embeddings", False)
        if "lm_head.weight" not in state and tied and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        state = self.rename_weights(state)
        missing: list[str] = []
        for prefix, fused, parts in _fused_params(self.model.layers, state):
            got = [state.pop(f"{prefix}.{p}", None) for p in parts]
            if any(g is None for g in got):
                missing += [f"{prefix}.{p}" for p, g in zip(parts, got) if g is None]
                continue
            state[f"{prefix}.{fused}"] = torch.cat(got, dim=0)
        result = self.load_state_dict(state, strict=False)
        missing += [m for m in result.missing_keys if not m.startswith("rotary.")]
        return missing, list(result.unexpected_keys)

    def rename_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Families whose checkpoints name or pack tensors differently convert them here."""
        return state


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _fused_params(layers: nn.ModuleList, state: dict[str, torch.Tensor]):
    """(module prefix, fused param name, HF param names stacked into it in order), for the
    fused projections a layer has and the checkpoint stores apart (Phi-3 stores them fused)."""
    for i, layer in enumerate(layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        # decided before yielding: the caller adds the fused names to state as it goes
        split_qkv = f"{attn}.qkv_proj.weight" not in state
        dense = isinstance(getattr(layer.mlp, "gate_up_proj", None), Linear)
        split_mlp = dense and f"{mlp}.gate_up_proj.weight" not in state
        for kind in ("weight", "bias"):
            if split_qkv and (kind == "weight" or f"{attn}.q_proj.bias" in state):
                yield attn, f"qkv_proj.{kind}", [f"{p}_proj.{kind}" for p in "qkv"]
            if split_mlp and (kind == "weight" or f"{mlp}.gate_proj.bias" in state):
                yield mlp, f"gate_up_proj.{kind}", [f"gate_proj.{kind}", f"up_proj.{kind}"]
