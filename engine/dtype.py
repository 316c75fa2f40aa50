"""`--dtype`: what `auto` resolves to, and why (logged once at start-up).

    checkpoint stores        CPU with native bf16     CPU without      GPU
    bfloat16 / float16       bfloat16                 float32          as stored
    float32 (or nothing)     float32                  float32          bfloat16

Native bf16 is a CPU flag (x86 `amx_bf16` or `avx512_bf16`, aarch64 `bf16`), as vLLM's CPU
backend checks: without one, bf16 matmuls are emulated and slower than float32. An explicit
`--dtype float32|bfloat16|float16` is always taken as given.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # the first one present is named in the log


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (x86 `flags`, aarch64 `Features`); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16_flag(flags: set[str] | None = None) -> str | None:
    """The flag that makes bf16 native on this CPU, None when it has none."""
    flags = cpu_flags() if flags is None else flags
    return next((f for f in _BF16_FLAGS if f in flags), None)


def stored_dtype(hf_config) -> str | None:
    """The checkpoint's dtype as config.json declares it (`torch_dtype`, or `dtype`)."""
    # `dtype` first: reading transformers 5's deprecated `torch_dtype` property logs a warning
    stored = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    return str(stored).replace("torch.", "") if stored else None


def explain_dtype(
    name: str, hf_config, device: torch.device, flags: set[str] | None = None
) -> tuple[torch.dtype, str]:
    """The dtype `--dtype name` serves in, and one line saying why."""
    if name != "auto":
        return DTYPES[name], f"--dtype {name}"
    stored = stored_dtype(hf_config)
    said = f"the checkpoint stores {stored or 'no dtype'}"
    if device.type != "cpu":
        if stored in ("bfloat16", "float16"):
            return DTYPES[stored], f"--dtype auto: {said}"
        return torch.bfloat16, f"--dtype auto: {said}, served as bfloat16 on {device.type}"
    if stored not in ("bfloat16", "float16"):
        return torch.float32, f"--dtype auto: {said}; --dtype bfloat16 to trade exactness for speed"
    flag = native_bf16_flag(flags)
    if flag is None:
        return torch.float32, f"--dtype auto: {said}, but this CPU has no native bf16"
    return torch.bfloat16, f"--dtype auto: {said}, CPU has native bf16 ({flag})"


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    dtype, why = explain_dtype(name, hf_config, device)
    logger.info("dtype: %s (%s)", str(dtype).replace("torch.", ""), why)
    return dtype
