"""Rotary position embedding (non-interleaved, rotate-half), with room for scaling variants.

The model prepares one rope batch per forward (prepare(positions, max_seq_len, dtype)), and each
attention layer rotates its q and k with it (rope.rotate(q, k)), so cos/sin are computed once per
step, not once per layer. The oracle computes cos/sin per token; the CPU kernel indexes a cos|sin
table by position and rotates q and k in place.

A scaling variant (engine/layers/rotary_scaling.py) is a subclass that overrides
inv_freq_values() (and attention_factor where cos/sin are scaled, angles() where the frequencies
depend on the position); rope_from_config() there maps Hugging Face's rope_type to the class.
"""

from __future__ import annotations

import torch

from engine.layers.base import KernelLayer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class NativeRope:
    """cos, sin: [T, 1, D] per token, broadcast over heads."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


class CpuRope:
    """positions [T] into cos_sin [>= max_len, D]; q, k rotated in place by the kernel."""

    def __init__(self, ops, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        self.ops, self.positions, self.cos_sin = ops, positions, cos_sin

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.rotary_embedding(self.positions, q, k, self.cos_sin)
        return q, k


class RotaryEmbedding(KernelLayer):
    """Default RoPE, cos/sin computed in float32 per position.

    inv_freq stays float32 whatever dtype the model is cast to (as Hugging Face computes it):
    in bf16 the frequencies would be off by up to 2^-9, the angle by ~1 rad at position 1000.
    """

    attention_factor = 1.0  # scaling variants that scale cos/sin set it

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        inv_freq = self._float_inv_freq(torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: torch.Tensor | None = None  # cos_sin_cache(), grown on demand

    def inv_freq_values(self) -> torch.Tensor:  # [D/2] float32; scaling variants override
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.base**exponent)

    def _float_inv_freq(self, device: torch.device) -> torch.Tensor:
        return self.inv_freq_values().to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._float_inv_freq(self.inv_freq.device)  # recomputed in float32
        self._cache = None
        return self

    def bind(self, impl: str) -> None:
        super().bind(impl)
        self.prepare = self.prepare_cpu if self.ops is not None else self.prepare_native

    def angles(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D/2] float32
        return positions.float()[:, None] * self.inv_freq[None, :]

    def forward_native(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin), each [T, 1, D], for the given positions."""
        freqs = self.angles(positions)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward_cpu(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.forward_native(positions, dtype)

    def prepare(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype):
        """The rope batch of one forward: NativeRope or CpuRope (bound by select())."""
        return self.prepare_native(positions, max_seq_len, dtype)

    def prepare_native(self, positions, max_seq_len: int, dtype) -> NativeRope:
        return NativeRope(*self.forward_native(positions, dtype))

    def prepare_cpu(self, positions, max_seq_len: int, dtype) -> CpuRope:
        return CpuRope(self.ops, positions, self.cos_sin_cache(max_seq_len, dtype))

    def cos_sin_cache(self, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """[>= max_len, D] = cos | sin of the half-dim frequencies, as forward() rounds them."""
        cache = self._cache
        if cache is None or cache.shape[0] < max_len or cache.dtype != dtype:
            n = max(max_len, 2 * (0 if cache is None else cache.shape[0]), 256)
            freqs = self.angles(torch.arange(n, device=self.inv_freq.device))
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            cache = torch.cat((cos.to(dtype), sin.to(dtype)), dim=-1)
            self._cache = cache
        return cache
