"""Attention backends over a paged KV cache, behind one interface (see backend.py).

auto: flash_attn where it imports on CUDA, else triton on CUDA, else "torch": on CPU the C++
kernels (pagedserve_kernels/cpu_backend.py) where they build, otherwise the pure-torch reference.
An explicit name is honoured on any device where its module imports (tests drive the
flash-attn path on CPU through a stand-in module).
"""

from __future__ import annotations

import importlib.util
import os

from pagedserve_kernels.backend import AttentionBackend, AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "default_block_size",
    "device_type",
    "get_attention_backend",
    "resolve_backend_name",
]

BACKENDS = ("flash_attn", "triton", "torch")
DEFAULT_BLOCK_SIZE = 16


def resolve_backend_name(name: str = "auto", device: str = "cpu") -> str:
    device = device_type(device)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
        return name
    if device != "cuda":
        return "torch"
    if _flash_attn_version() is not None:
        return "flash_attn"
    return "triton" if importlib.util.find_spec("triton") else "torch"


def default_block_size(name: str = "auto", device: str = "auto") -> int:
    """16, except 256 where flash-attn 2 will run (its paged KV needs multiples of 256)."""
    if resolve_backend_name(name, device) == "flash_attn" and _flash_attn_version() == 2:
        from pagedserve_kernels.flash_attn import FA2_BLOCK_SIZE_MULTIPLE

        return FA2_BLOCK_SIZE_MULTIPLE
    return DEFAULT_BLOCK_SIZE


def get_attention_backend(
    name: str = "auto", device: str = "cpu", block_size: int | None = None, dtype=None
) -> AttentionBackend:
    """Build the backend; ValueError (said plainly) when it cannot run here or with block_size."""
    device = device_type(device)
    resolved = resolve_backend_name(name, device)
    if resolved == "flash_attn" and device == "cuda" and not _half(dtype):
        if name != "auto":
            raise ValueError(
                f"attention backend flash_attn computes in float16/bfloat16, not {dtype}; "
                "use --dtype bfloat16 or --attention-backend triton"
            )
        resolved = "triton"  # auto with float32: the Triton kernel computes any float dtype
    if resolved == "flash_attn":
        return _build_flash_attn(device, block_size)
    if resolved == "triton":
        return _build_triton(device)
    return _build_torch(device)


def _build_torch(device: str) -> AttentionBackend:
    """On CPU the C++ kernels' backend; the pure-torch reference where they do not build or are
    turned off (PAGEDSERVE_CPU_KERNELS=0), and on other devices."""
    from pagedserve_kernels.reference import TorchAttentionBackend

    if device == "cpu":
        from pagedserve_kernels.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()
        if ops is not None:
            from pagedserve_kernels.cpu_backend import CpuAttentionBackend

            return CpuAttentionBackend(ops)
    return TorchAttentionBackend()


def _build_flash_attn(device: str, block_size: int | None) -> AttentionBackend:
    from pagedserve_kernels.flash_attn import (
        FlashAttentionBackend,
        check_block_size,
        import_flash_attn,
    )

    found = import_flash_attn()
    if found is None:
        raise ValueError(
            "attention backend flash_attn: neither flash_attn_interface (flash-attn 3) nor "
            "flash_attn (flash-attn 2) is installed; pip install flash-attn, or choose "
            "--attention-backend triton/torch"
        )
    module, version = found
    if block_size is not None:
        check_block_size(block_size, version)
    store_kv = None
    if device == "cuda" and importlib.util.find_spec("triton"):
        from pagedserve_kernels.triton_attention import store_kv
    return FlashAttentionBackend(module, version, store_kv)


def _build_triton(device: str) -> AttentionBackend:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention backend triton: triton is not installed (pip install triton)")
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention backend triton runs on CUDA; on CPU it needs TRITON_INTERPRET=1 "
            "(Triton's interpreter, for tests)"
        )
    from pagedserve_kernels.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _flash_attn_version() -> int | None:
    """3 or 2 if it imports (a wheel built for another torch fails here, not later), else None."""
    from pagedserve_kernels.flash_attn import import_flash_attn

    found = import_flash_attn()
    return None if found is None else found[1]


def _half(dtype) -> bool:
    import torch

    return dtype is None or dtype in (torch.float16, torch.bfloat16)


def device_type(device) -> str:
    device = str(getattr(device, "type", device))
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]
