"""Attention backends over a paged KV cache, behind one interface (see backend.py)."""

from __future__ import annotations

from kernels.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Resolve --attention-backend; 'auto' is the torch reference until faster paths land."""
    if name in ("auto", "torch"):
        from kernels.reference import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available in this build")
