"""Llama-family decoder (Llama, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, optional tied embeddings.

Runs one flattened batch of tokens from many sequences (no padding); attention goes through a
paged-KV backend from kernels/. Numerics follow Hugging Face's implementation op for op so that
float32 greedy decoding matches transformers token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]

# Decode steps up to this many sequences run every layer in one kernel call (ops.decode_layers);
# the AMX linears take every decode-sized call up to here (kernels/cpu_linear.py AMX_MAX_ROWS).
FUSED_DECODE_MAX_ROWS = 32


class RMSNorm(nn.Module):
    """norm(x), or with a residual: residual = x + residual, then norm(residual).

    The fused CPU kernel (ops) writes both in place in one pass; the torch ops are the oracle.
    """

    def __init__(self, hidden_size: int, eps: float, ops=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.ops is not None:
            if residual is None:
                out = torch.empty_like(x)
                self.ops.rms_norm(out, x, self.weight, self.eps)
                return out
            self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, cos/sin computed in float32 per position.

    inv_freq stays float32 whatever dtype the model is cast to (as Hugging Face computes it):
    in bf16 the frequencies would be off by up to 2^-9, the angle by ~1 rad at position 1000.
    """

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)
        self._cache: torch.Tensor | None = None  # cos_sin_cache(), grown on demand

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return (1.0 / (self.base**exponent)).to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.inv_freq.device)  # recomputed in float32
        self._cache = None
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # [T, 1, D]

    def cos_sin_cache(self, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """[>= max_len, D] = cos | sin of the half-dim frequencies, as forward() rounds them."""
        cache = self._cache
        if cache is None or cache.shape[0] < max_len or cache.dtype != dtype:
            n = max(max_len, 2 * (0 if cache is None else cache.shape[0]), 256)
            freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq
            cache = torch.cat((freqs.cos().to(dtype), freqs.sin().to(dtype)), dim=-1)
            self._cache = cache
        return cache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, ops=None) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = getattr(cfg, "attention_bias", False)
        h, d = cfg.hidden_size, self.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # One GEMM for q, k and v (loaded from HF's q_proj/k_proj/v_proj, see load_weights).
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.backend = backend

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.ops is not None:  # rope = (positions, cos|sin cache): rotated in place
            self.ops.rotary_embedding(rope[0], q, k, rope[1])
        else:  # rope = (cos, sin) per token
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self.backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, ops=None) -> None:
        super().__init__()
        self.ops = ops
        bias = getattr(cfg, "mlp_bias", False)
        self.intermediate_size = cfg.intermediate_size
        # gate and up in one GEMM (loaded from HF's gate_proj/up_proj, see load_weights).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.ops is not None:
            h = gate_up.new_empty(x.shape[0], self.intermediate_size)
            self.ops.silu_and_mul(h, gate_up)
            return self.down_proj(h)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, ops=None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, ops)
        self.mlp = LlamaMLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

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
    def __init__(self, cfg, backend: AttentionBackend, ops=None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, ops) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """ops: the fused CPU kernels (kernels.cpu_ops), or None for plain torch ops."""

    def __init__(self, cfg, backend: AttentionBackend, ops=None) -> None:
        super().__init__()
        _check_rope_scaling(cfg)
        self.config = cfg
        self.ops = ops
        self.model = LlamaModel(cfg, backend, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(
            head_dim, getattr(cfg, "rope_theta", None) or _rope_theta(cfg)
        )
        self._fused_weights: list[torch.Tensor] | None = None  # see _fused_decode_weights

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.model.embed_tokens(input_ids)
        if self.ops is not None:
            cos_sin = self.rotary.cos_sin_cache(meta.max_seq_len, x.dtype)
            if meta.is_decode_only and x.shape[0] <= FUSED_DECODE_MAX_ROWS:
                weights = self._fused_decode_weights()
                if weights is not None:
                    return self._fused_decode(x, positions, cos_sin, meta, kv_caches, weights)
            rope = (positions, cos_sin)
        else:
            rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    def _fused_decode_weights(self) -> list[torch.Tensor] | None:
        """Six tensors per layer for ops.decode_layers, or None where it does not apply: every
        projection an AMX-packed PackedLinear without bias, bf16, the kernels' attention backend."""
        if self._fused_weights is None:
            self._fused_weights = _collect_fused_decode_weights(self) or []
        return self._fused_weights or None

    def _fused_decode(self, x, positions, cos_sin, meta: AttentionMetadata, kv_caches, weights):
        """A decode step through every layer in one call of ops.decode_layers (the kernels the
        modules call, in the same order: the same bits, without the Python between them)."""
        attn = self.model.layers[0].self_attn
        plan = attn.backend.cascade_plan(
            attn.num_heads, x.dtype, kv_caches[0][0], meta.block_table, meta.seq_lens,
            meta.decode_shared_blocks,
        )
        none = x.new_empty(0, dtype=torch.int32)
        prefix_blocks, prefix_len, suffix_table, suffix_lens = plan or (none, 0, none, none)
        norm = self.model.norm
        return self.ops.decode_layers(
            x, positions, cos_sin, weights, [c for kv in kv_caches for c in kv], norm.weight,
            meta.slot_mapping, meta.block_table, meta.seq_lens, prefix_len, prefix_blocks,
            suffix_table, suffix_lens, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            norm.eps, attn.scale,
        )

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


def _collect_fused_decode_weights(model: LlamaForCausalLM) -> list[torch.Tensor] | None:
    from kernels.cpu_linear import PackedLinear

    ops = model.ops
    if ops is None or not hasattr(ops, "decode_layers"):
        return None
    if model.model.embed_tokens.weight.dtype != torch.bfloat16:
        return None
    weights: list[torch.Tensor] = []
    eps = {model.model.norm.eps}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, PackedLinear) and m.ops is not None for m in linears):
            return None  # some projection is not AMX-packed (bias, shape, no AMX)
        if getattr(attn.backend, "ops", None) is None or not hasattr(attn.backend, "cascade_plan"):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        eps.update(n.eps for n in norms)
        weights += [norms[0].weight, linears[0].amx, linears[1].amx]
        weights += [norms[1].weight, linears[2].amx, linears[3].amx]
    return weights if len(eps) == 1 else None


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


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))


def _check_rope_scaling(cfg) -> None:
    scaling = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"rope scaling {kind!r} is not supported yet")
