"""Qwen2.5-VL's vision tower, from our layers: patch embedding over temporal patches, 2-D rotary,
window-attention and full-attention blocks, and the 2x2 patch merger.

Input: the image processor's flattened patches [sum of t*h*w, C*T*P*P] (merge-block-major: the
m*m patches of one merged token are consecutive) and each image's grid (t, h, w) in patches.
The merged tokens are reordered window by window (windows of window_size pixels); window layers
attend within a window, the fullatt_block_indexes layers within an image (the attention
backend's non-causal encoder_attention; SDPA batches each run of equal-length segments); the
merger's output goes back to raster order. Module names follow transformers'
(visual.blocks[i].attn.qkv, ...) so weights load as they are; the patch embedding's Conv3d
weight loads into an equivalent Linear.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.layers import Linear, RMSNorm
from engine.layers.mrope import VisionRotary
from engine.models.vision_tower import activation, encoder_backend
from pagedserve_kernels import AttentionBackend


def merged_grid(grid_thw, merge: int) -> tuple[int, int, int]:
    t, h, w = grid_thw
    return t, h // merge, w // merge


def window_order(grid_thw, merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """(merged-token order window by window, the length of each window in merged tokens) of one
    image: windows of `window` x `window` merged tokens tile each frame row-major; a window lists
    its tokens in raster order."""
    t, h, w = merged_grid(grid_thw, merge)
    ti, r, c = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    ti, r, c = ti.ravel(), r.ravel(), c.ravel()
    window_id = (ti * -(-h // window) + r // window) * -(-w // window) + c // window
    order = np.lexsort((c, r, window_id))  # by window, then row, then column
    return order, np.bincount(window_id).tolist()


def patch_positions(grid_thw, merge: int) -> np.ndarray:
    """[t*h*w, 2] (row, column) of every patch in the processor's merge-block-major order."""
    t, h, w = grid_thw
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    r = r.reshape(shape).transpose(0, 2, 1, 3).ravel()
    c = c.reshape(shape).transpose(0, 2, 1, 3).ravel()
    return np.tile(np.stack([r, c], axis=1), (t, 1))


class VisionAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.backend = encoder_backend(backend)
        self.num_heads = cfg.num_heads
        self.head_dim = d // self.num_heads
        self.qkv = Linear(d, 3 * d, bias=True)
        self.proj = Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor, rope, lengths: list[int]) -> torch.Tensor:  # [N, D]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rope.rotate(q, k)
        out = self.backend.encoder_attention(q, k, v, lengths, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = Linear(d, i, bias=True), Linear(d, i, bias=True)
        self.down_proj = Linear(i, d, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg, backend)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m*m neighbouring patches -> one text-width token: RMSNorm, then a GELU MLP."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, bias=True),
            nn.GELU(),
            Linear(self.width, cfg.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one temporal patch) as the Linear it equals."""

    def __init__(self, cfg) -> None:
        super().__init__()
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        self.linear = Linear(cfg.in_channels * tp * p * p, cfg.hidden_size, bias=False)
        # follows the model's dtype (a packed bf16 Linear drops its weight)
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.linear(patches.to(self.dtype_probe.dtype))


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.merge = cfg.spatial_merge_size
        self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.full_layers = set(cfg.fullatt_block_indexes)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(cfg)
        self.rotary_pos_emb = VisionRotary(head_dim, theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg, backend) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[sum patches, C*T*P*P] of the images in `grids` -> [sum merged tokens, out hidden]."""
        unit = self.merge**2
        orders, windows, frames, positions, base = [], [], [], [], 0
        for grid in grids:
            order, lengths = window_order(grid, self.merge, self.window)
            orders.append(order + base)
            windows += [n * unit for n in lengths if n]
            frames += [grid[1] * grid[2]] * grid[0]
            positions.append(patch_positions(grid, self.merge))
            base += len(order)
        order = torch.from_numpy(np.concatenate(orders)).to(patches.device)
        rows_cols = torch.from_numpy(np.concatenate(positions)).to(patches.device)
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)  # merged tokens window by window
        rows_cols = rows_cols.view(-1, unit, 2)[order].flatten(0, 1)
        rope = self.rotary_pos_emb(rows_cols, x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames if i in self.full_layers else windows)
        return self.merger(x)[torch.argsort(order)]
