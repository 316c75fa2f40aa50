"""RoPE scaling variants of Hugging Face's rope_parameters (rope_scaling) and the one place that
maps a config to its rotary layer.

Each variant changes only the float32 frequencies (and, for yarn and longrope, a factor on cos
and sin), so the CPU kernel's cos|sin table serves all of them. `dynamic` NTK scaling only
changes the frequencies past max_position_embeddings, which max_model_len never exceeds, so it
serves the default frequencies.
"""

from __future__ import annotations

import math

import torch

from engine.layers.rotary import RotaryEmbedding


class ScaledRotaryEmbedding(RotaryEmbedding):
    """A variant built from the rope parameters dict and the model's max_position_embeddings."""

    def __init__(self, head_dim: int, base: float, params: dict, max_positions: int) -> None:
        self.params, self.max_positions = params, max_positions
        super().__init__(head_dim, base)

    def default_inv_freq(self) -> torch.Tensor:
        return super().inv_freq_values()

    def original_max_positions(self) -> int:
        return int(self.params.get("original_max_position_embeddings") or self.max_positions)


class LinearRotaryEmbedding(ScaledRotaryEmbedding):
    """Position interpolation: every frequency divided by factor."""

    def inv_freq_values(self) -> torch.Tensor:
        return self.default_inv_freq() / float(self.params["factor"])


class DynamicRotaryEmbedding(ScaledRotaryEmbedding):
    """Dynamic NTK: the default frequencies up to max_position_embeddings (the engine's limit)."""


class Llama3RotaryEmbedding(ScaledRotaryEmbedding):
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between."""

    def inv_freq_values(self) -> torch.Tensor:
        inv_freq = self.default_inv_freq()
        p = self.params
        factor, low = float(p["factor"]), float(p["low_freq_factor"])
        high = float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)


class YarnRotaryEmbedding(ScaledRotaryEmbedding):
    """YaRN: interpolated and extrapolated frequencies blended over a ramp of dimensions, and
    cos/sin scaled by the attention factor."""

    def __init__(self, head_dim: int, base: float, params: dict, max_positions: int) -> None:
        super().__init__(head_dim, base, params, max_positions)
        self.attention_factor = self._attention_factor()

    def _factor(self) -> float:
        factor = self.params.get("factor")
        return float(factor) if factor else self.max_positions / self.original_max_positions()

    def _attention_factor(self) -> float:
        given = self.params.get("attention_factor")
        if given is not None:
            return float(given)
        mscale, mscale_all = self.params.get("mscale"), self.params.get("mscale_all_dim")
        factor = self._factor()
        if mscale and mscale_all:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
        return _yarn_mscale(factor)

    def inv_freq_values(self) -> torch.Tensor:
        dim, base = self.head_dim, self.base
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self._factor() * pos_freqs)
        beta_fast = self.params.get("beta_fast") or 32
        beta_slow = self.params.get("beta_slow") or 1
        low, high = self._correction_range(beta_fast, beta_slow)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # share of the extrapolated (unscaled) frequency per dimension
        return interpolation * (1 - keep) + extrapolation * keep

    def _correction_range(self, fast: float, slow: float) -> tuple[float, float]:
        dim, base, orig = self.head_dim, self.base, self.original_max_positions()

        def dim_of(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(fast), dim_of(slow)
        if self.params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class LongRotaryEmbedding(ScaledRotaryEmbedding):
    """Phi-3's longrope: per-dimension factors, short_factor below
    original_max_position_embeddings and long_factor from there on (per position, as vLLM), and
    cos/sin scaled by sqrt(1 + log(factor) / log(original))."""

    def __init__(self, head_dim: int, base: float, params: dict, max_positions: int) -> None:
        super().__init__(head_dim, base, params, max_positions)
        orig = self.original_max_positions()
        factor = params.get("factor") or max_positions / orig
        given = params.get("attention_factor")
        if given is not None:
            self.attention_factor = float(given)
        elif factor > 1.0:
            self.attention_factor = math.sqrt(1 + math.log(factor) / math.log(orig))

    def _scaled(self, key: str) -> torch.Tensor:
        ext = torch.tensor(self.params[key], dtype=torch.float32)
        shape = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (ext * self.base**shape)

    def inv_freq_values(self) -> torch.Tensor:
        return self._scaled("short_factor")

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        long = self._scaled("long_factor").to(self.inv_freq.device)
        pos = positions.float()[:, None]
        beyond = positions[:, None] >= self.original_max_positions()
        return torch.where(beyond, pos * long[None, :], pos * self.inv_freq[None, :])


ROPE_TYPES: dict[str, type[RotaryEmbedding]] = {
    "default": RotaryEmbedding,
    "linear": LinearRotaryEmbedding,
    "dynamic": DynamicRotaryEmbedding,
    "llama3": Llama3RotaryEmbedding,
    "yarn": YarnRotaryEmbedding,
    "longrope": LongRotaryEmbedding,
}


def rope_parameters(cfg) -> dict:
    """The config's rope dict (rope_parameters in transformers 5, rope_scaling before)."""
    return dict(getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {})


def rope_type(cfg) -> str:
    params = rope_parameters(cfg)
    return params.get("rope_type", params.get("type", "default")) or "default"


def check_rope(cfg) -> None:
    """ValueError naming an unsupported rope type and listing the supported ones."""
    kind = rope_type(cfg)
    if kind not in ROPE_TYPES:
        names = ", ".join(sorted(ROPE_TYPES))
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: {names})")
    partial = rope_parameters(cfg).get("partial_rotary_factor") or getattr(
        cfg, "partial_rotary_factor", 1.0
    )
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")


def rope_from_config(cfg, head_dim: int) -> RotaryEmbedding:
    """The RotaryEmbedding a Hugging Face config asks for; ValueError for a kind not in
    ROPE_TYPES (the message lists those that are)."""
    check_rope(cfg)
    kind, params = rope_type(cfg), rope_parameters(cfg)
    if kind == "default":
        return RotaryEmbedding(head_dim, rope_theta(cfg))
    if "original_max_position_embeddings" not in params:
        orig = getattr(cfg, "original_max_position_embeddings", None)
        if orig:
            params["original_max_position_embeddings"] = orig
    max_positions = int(getattr(cfg, "max_position_embeddings", None) or 2048)
    return ROPE_TYPES[kind](head_dim, rope_theta(cfg), params, max_positions)


def rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta:
        return float(theta)
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))
