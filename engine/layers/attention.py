"""Paged attention over one layer's KV cache: writes the new tokens' K/V by slot, then attends
through the attention backend (pagedserve_kernels/), which chose its own kernels when it was built.

A layer may have a sliding window (window W: the query at position i sees keys i - W < j <= i,
Hugging Face's sliding_window) and attention-logit soft-capping (scores = c * tanh(scores / c)).
Models whose layers attend differently keep one block table per KV cache group
(engine/core/kv_cache_groups.py); the runner then passes a GroupedAttentionMetadata and tells each
layer its group (kv_group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedserve_kernels import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class GroupedAttentionMetadata(AttentionMetadata):
    """Group 0's metadata (this object's own fields) plus every group's, in group order: the
    groups share the batch (lengths, positions) and differ in block tables and slots."""

    groups: list[AttentionMetadata] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.window = window  # 0: full attention
        self.softcap = softcap  # 0.0: none
        self.kv_group = 0  # set by the runner when the model has several KV cache groups

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [T, H * D]
        if self.kv_group:
            meta = meta.groups[self.kv_group]
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.window or self.softcap:
            o = self.backend.forward(
                q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap
            )
        else:  # the plain call: backends without windows or caps serve every other layer
            o = self.backend.forward(q, k_cache, v_cache, meta, self.scale)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return f"window={self.window}, softcap={self.softcap}, kv_group={self.kv_group}"


def layer_windows(cfg) -> list[int]:
    """Each decoder layer's sliding window from a Hugging Face config (0: full attention).

    layer_types (transformers 5) names each layer's kind; without it, sliding_window_pattern p
    makes every p-th layer global (older Gemma 3 configs), and a bare sliding_window applies to
    every layer (Mistral). use_sliding_window False (Qwen2/3) turns the window off.
    """
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not window:
        return [0] * n
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else 0 for t in types[:n]]
    pattern = getattr(cfg, "sliding_window_pattern", None)
    if pattern:
        return [window if (i + 1) % pattern else 0 for i in range(n)]
    return [window] * n
