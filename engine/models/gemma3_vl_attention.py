"""Bidirectional attention among one image's tokens over the causal paged backends (Gemma 3).

transformers' Gemma 3 mask for a query q inside an image whose tokens end at E (exclusive):
global layers see every key k <= q and every key of the same image, so every k < E; sliding
layers (window W) see AND(k > q - W, k <= q OR same image), so every k in (q - W, E). Text
queries stay causal. The backend first runs every row causally (and writes the step's K/V into
the paged cache); then the rows of image queries are recomputed here in float32 over the keys
they may see, read back from the cache through the layer's own block table. The scheduler
never splits an image's tokens over chunks (ImageInput.whole), so keys up to E are written by
the time a step holds an image's queries.
"""

from __future__ import annotations

import torch

from engine.layers import Attention


class StepImages:
    """This step's image query spans, shared by the model and its attention layers: (first
    row in the flat batch, rows, sequence index, image end position)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int, int]] = []


class ImageAwareAttention(Attention):
    step: StepImages

    @classmethod
    def wrap(cls, attn: Attention, step: StepImages) -> ImageAwareAttention:
        new = cls(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, attn.backend,
            attn.window, attn.softcap,
        )  # fmt: skip
        new.step = step
        return new

    def forward(self, q, k, v, meta, kv_cache) -> torch.Tensor:  # [T, H * D]
        o = super().forward(q, k, v, meta, kv_cache)
        if not self.step.spans:
            return o
        if self.kv_group:
            meta = meta.groups[self.kv_group]
        o = o.clone()
        for row, n, seq, end in self.step.spans:
            rows = self._image_rows(q[row : row + n], end, meta.block_table[seq], kv_cache)
            o[row : row + n] = rows.to(o.dtype)
        return o

    def _image_rows(self, q: torch.Tensor, end: int, table: torch.Tensor, kv_cache):
        """[n, H * D] outputs of the n queries at positions end - n .. end - 1."""
        k_cache, v_cache = kv_cache
        n, block = q.shape[0], k_cache.shape[1]
        device = q.device
        q_pos = torch.arange(end - n, end, device=device)
        lo = max(0, end - n - self.window + 1) if self.window else 0
        k_pos = torch.arange(lo, end, device=device)
        slots = table[k_pos // block].long() * block + k_pos % block
        flat = (-1, self.num_kv_heads, self.head_dim)
        keys = k_cache.view(flat)[slots].float()  # [L, Hkv, D]
        values = v_cache.view(flat)[slots].float()
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.window:  # AND(k > q - W, k < E): keys past q are the image's own
            visible = k_pos[None, :] > q_pos[:, None] - self.window
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values).reshape(n, -1)
