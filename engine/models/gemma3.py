"""Gemma 3 (text): Gemma 2's layer plus a (1 + weight) RMSNorm on each head's q and k before
RoPE, and two rotary bases: local (sliding-window) layers use rope_local_base_freq (10k), global
layers rope_theta (1M) with the config's rope scaling. Soft-capping is off unless the config sets
it (Gemma3ForCausalLM applies final_logit_softcapping when set, as transformers does).

transformers 5 keeps both in rope_parameters {"sliding_attention": {...}, "full_attention":
{...}}; older configs say rope_theta, rope_local_base_freq and rope_scaling (global only).
"""

from __future__ import annotations

import torch

from engine.layers import RMSNorm, check_rope, rope_from_config
from engine.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaAttention
from engine.models.llama import head_dim_of
from pagedserve_kernels import AttentionBackend


class Gemma3Attention(GemmaAttention):
    def __init__(self, cfg, backend: AttentionBackend, window: int = 0) -> None:
        super().__init__(cfg, backend, window)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # over head_dim of [T, H, D] and [T, Hkv, D]


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class RopeConfig:
    """The attributes of a config that rope_from_config reads, for one layer kind."""

    def __init__(self, params: dict, max_position_embeddings: int | None) -> None:
        self.rope_parameters = dict(params)
        self.rope_theta = float(params.get("rope_theta") or 10_000.0)
        self.max_position_embeddings = max_position_embeddings


def rope_configs(cfg) -> dict[str, RopeConfig]:
    """A config-like view per layer kind ("full_attention", "sliding_attention") that
    rope_from_config reads: that kind's rope parameters and theta."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" not in params:  # the flat, older form
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
        params = {
            "full_attention": {**scaling, "rope_theta": getattr(cfg, "rope_theta", 1_000_000.0)},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": getattr(cfg, "rope_local_base_freq", 10_000.0),
            },
        }
    max_positions = getattr(cfg, "max_position_embeddings", None)
    return {kind: RopeConfig(p, max_positions) for kind, p in params.items()}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        ropes = rope_configs(cfg)
        head_dim = head_dim_of(cfg)
        self.rotary = rope_from_config(ropes["full_attention"], head_dim)
        self.rotary_local = rope_from_config(ropes["sliding_attention"], head_dim)

    def layer_ropes(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> list:
        """Local layers rotate with the local base, global ones with rope_theta and its scaling."""
        rope_global = self.rotary.prepare(positions, max_seq_len, dtype)
        rope_local = self.rotary_local.prepare(positions, max_seq_len, dtype)
        return [rope_local if layer.is_sliding else rope_global for layer in self.model.layers]

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        super().check_config(cfg, max_model_len)
        for rope_cfg in rope_configs(cfg).values():
            check_rope(rope_cfg)
