"""Fused CPU kernels (kernels/csrc/cpu_ops.cpp), compiled on first use and cached.

    ops = load_cpu_ops()   # torch.ops.pagedserve_cpu, or None: use the torch ops instead

The build lands in $PAGEDSERVE_CACHE/kernels/<hash of source, torch, CPU flags> (or under the
temp dir when the cache is read-only, as in the CPU image), so a second start loads it in well
under a second; a machine without a C++ compiler logs one warning and serves on the plain torch
path. PAGEDSERVE_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]


def cpu_kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") not in ("0", "false", "off")


@functools.cache
def load_cpu_ops():
    """torch.ops.pagedserve_cpu after building (or reusing) the extension; None if it can't."""
    if not cpu_kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        _ensure_ninja_on_path()
        load(
            name="pagedserve_cpu_ops",
            sources=[str(SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("CPU kernels unavailable, using plain torch ops (%s)", exc)
        return None
    return torch.ops.pagedserve_cpu


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits beside python, maybe not there."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build_dir() -> Path:
    from engine.model_loader import default_cache_dir

    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_FLAGS).encode())
    key.update(_cpu_flags().encode())
    name = key.hexdigest()[:16]
    for root in (default_cache_dir() / "kernels", Path(tempfile.gettempdir()) / "pagedserve"):
        try:
            (root / name).mkdir(parents=True, exist_ok=True)
            probe = root / name / ".writable"
            probe.touch()
            return root / name
        except OSError:
            continue
    raise OSError("no writable directory for the kernel build")


def _cpu_flags() -> str:
    """-march=native code is only valid on this CPU model: its flags are part of the key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
