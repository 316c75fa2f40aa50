"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position components per
token (temporal, height, width); `mrope_section` splits the half-dim frequencies into three
runs, run i rotated by component i.

A token whose three components are equal (every text token) rotates exactly as plain RoPE at
that position, so the model takes either positions [T] (text-only steps, decode: the fused and
CPU-kernel paths of RotaryEmbedding run unchanged) or positions [3, T] (a step that holds image
tokens: cos/sin computed here per token, in float32 as transformers does; on the CPU kernels
the same cos|sin, one row per token, go through the rotary kernel with positions 0..T-1, so an
image step rotates q and k in place in one call per layer instead of a dozen tensor ops).
"""

from __future__ import annotations

import torch

from engine.layers.base import KernelLayer
from engine.layers.rotary import CpuRope, NativeRope, RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, base: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, base)
        if sum(mrope_section) != head_dim // 2 or len(mrope_section) != 3:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must be 3 runs summing to head_dim/2 "
                f"({head_dim // 2})"
            )
        # the position component (0: t, 1: h, 2: w) of each half-dim frequency
        comp = torch.cat([torch.full((n,), i) for i, n in enumerate(mrope_section)])
        self.register_buffer("component", comp, persistent=False)  # int64: never cast
        self.mrope_section = list(mrope_section)

    def bind(self, impl: str) -> None:
        super().bind(impl)
        self._plain_prepare = self.prepare  # RotaryEmbedding's choice for 1-D positions
        self.prepare = self.prepare_mrope

    def prepare(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype):
        return self.prepare_mrope(positions, max_seq_len, dtype)

    def prepare_mrope(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype):
        """positions [T]: plain RoPE (any bound implementation); [3, T]: M-RoPE."""
        if positions.dim() == 1:
            plain = getattr(self, "_plain_prepare", None) or self.prepare_native
            return plain(positions, max_seq_len, dtype)
        if self.ops is not None:  # the CPU kernel over a per-token cos|sin table, row t for token t
            freqs = self.mrope_freqs(positions)
            table = torch.cat((freqs.cos().to(dtype), freqs.sin().to(dtype)), dim=-1)
            rows = torch.arange(freqs.shape[0], device=positions.device)
            return CpuRope(self.ops, rows, table)
        return NativeRope(*self.forward_mrope(positions, dtype))

    def mrope_freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, D/2] float32 angles from positions [3, T]: frequency j takes component[j]."""
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, D/2]
        index = self.component.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        return freqs.gather(0, index)[0]

    def forward_mrope(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin), each [T, 1, D], from positions [3, T]."""
        freqs = self.mrope_freqs(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class VisionRotary(KernelLayer):
    """Axial 2-D RoPE: the first half of the rotated dims by row, the second by column.

    Returns the rope of one tower call: rotate(q, k) in float32 as transformers computes it (the
    CPU rotary kernel over a per-patch cos|sin table when the tower runs in float32; the torch
    ops otherwise, so bf16 still rotates in float32 and rounds once)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.inv_freq = 1.0 / theta**quarter  # float32 whatever the model's dtype: no buffer

    def freqs(self, rows_cols: torch.Tensor) -> torch.Tensor:  # [N, D/2] float32
        inv_freq = self.inv_freq.to(rows_cols.device)
        return (rows_cols[..., None].float() * inv_freq).flatten(1)  # rows' then columns'

    def forward_native(self, rows_cols: torch.Tensor, dtype: torch.dtype):
        emb = torch.cat((self.freqs(rows_cols),) * 2, dim=-1)[:, None, :]  # [N, 1, D]
        return VisionNativeRope(emb.cos(), emb.sin())

    def forward_cpu(self, rows_cols: torch.Tensor, dtype: torch.dtype):
        if dtype != torch.float32:
            return self.forward_native(rows_cols, dtype)
        freqs = self.freqs(rows_cols)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return CpuRope(self.ops, torch.arange(freqs.shape[0], device=freqs.device), table)


class VisionNativeRope(NativeRope):
    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q2, k2 = super().rotate(q.float(), k.float())
        return q2.to(q.dtype), k2.to(k.dtype)
