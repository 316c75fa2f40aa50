"""Fused CPU kernels (pagedserve_kernels/csrc/, one .cpp per family), compiled on first use and
cached; `make setup` builds them ahead (`python -m pagedserve_kernels.cpu_ops`).

    ops = load_cpu_ops()   # torch.ops.pagedserve_cpu, or None: use the torch ops instead

Every .cpp in pagedserve_kernels/csrc/ is compiled (ninja builds them in parallel) and linked into
one extension; pagedserve_kernels/csrc/registration.cpp registers the ops. The build lands in
$PAGEDSERVE_CACHE/kernels/<build_key()> (or under the temp dir when the cache is read-only, as
in the CPU image), a hash over every source and header, torch, the flags and the CPU's flags, so
editing any file rebuilds and a second start loads it in well under a second; a machine without
a C++ compiler logs one warning and serves on the plain torch path. PAGEDSERVE_CPU_KERNELS=0
turns the kernels off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]


def cpu_kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") not in ("0", "false", "off")


# `pagedserve serve --batch-invariant` sets the first; vLLM's name works too.
BATCH_INVARIANT_ENV = ("PAGEDSERVE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")


def batch_invariant() -> bool:
    """Whether the kernels compute each row in an order that does not depend on the batch: the
    linears on dense_linear at every row count, and all attention (decode rows too) through the
    prefill kernel, no cascade. It holds where those kernels cover the model (bf16, AMX or
    AVX-512 BF16, head_dim a multiple of 32 from 64 to 256, block_size a multiple of 16);
    elsewhere the usual paths run.
    Read when a model loads (pagedserve_kernels/cpu_linear.py, pagedserve_kernels/cpu_backend.py);
    bench/batch_invariance.py measures the check and the cost."""
    return any(
        os.environ.get(name, "0") not in ("", "0", "false", "off") for name in BATCH_INVARIANT_ENV
    )


BUILD_MARKER = ".build-complete"  # written after a build loaded; its absence means redo it
BUILD_TIME_HINT = "about 35 s on a quiet 2-core machine, minutes on a busy one"


@functools.cache
def load_cpu_ops():
    """torch.ops.pagedserve_cpu after building (or reusing) the extension; None if it can't."""
    if not cpu_kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        _ensure_ninja_on_path()
        with build_lock(build_dir):
            if not is_built(build_dir):
                _clear_partial_build(build_dir)
                logger.info(
                    "compiling the CPU kernels (pagedserve_kernels/csrc) into %s, once per "
                    "source change (%s; `make setup` does it ahead)",
                    build_dir,
                    BUILD_TIME_HINT,
                )
            load(
                name="pagedserve_cpu_ops",
                sources=[str(path) for path in sources()],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            (build_dir / BUILD_MARKER).write_text(build_key() + "\n")
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("CPU kernels unavailable, using plain torch ops (%s)", exc)
        return None
    return torch.ops.pagedserve_cpu


def is_built(build_dir: Path | None = None) -> bool:
    """Whether the build directory holds a build that finished and loaded (its marker)."""
    try:
        build_dir = build_dir or _build_dir()
        return (build_dir / BUILD_MARKER).read_text().strip() == build_key()
    except OSError:
        return False


def _clear_partial_build(build_dir: Path) -> None:
    """A build without its marker was cut short (killed mid-compile or mid-link): its objects
    and library may be half-written, so none of it is reused."""
    for path in build_dir.iterdir():
        if path.name in (".build.flock", ".writable"):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """One builder per directory at a time, under an flock the kernel drops if its holder dies.

    torch's own lock is a file that a killed build leaves behind, and every later start would
    wait on it forever; holding the flock means no build is running, so that file is stale."""
    with open(build_dir / ".build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits beside python, maybe not there."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def sources(csrc: Path = CSRC) -> list[Path]:
    """The extension's translation units: every .cpp in csrc, in name order."""
    return sorted(csrc.glob("*.cpp"))


def build_key(csrc: Path = CSRC) -> str:
    """Name of the build directory: a hash of every source and header in csrc (names and bytes),
    their folder, the torch version, the compiler flags and this CPU's flags.

    The folder is part of the key because ninja rebuilds when a source's path changes: two
    checkouts of the same sources sharing one build directory would rebuild it in turn."""
    key = hashlib.sha256()
    key.update(str(csrc.resolve()).encode())
    for path in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        data = path.read_bytes()
        # length-prefixed, so moving text from one file to the next changes the key too
        key.update(f"{path.name}:{len(data)}:".encode())
        key.update(data)
    key.update(torch.__version__.encode())
    key.update(" ".join(_FLAGS).encode())
    key.update(_cpu_flags().encode())
    return key.hexdigest()[:16]


def _cache_root() -> Path:
    """$PAGEDSERVE_CACHE or ~/.cache/pagedserve: the engine keeps converted models there too."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def _build_dir() -> Path:
    name = build_key()
    for root in (_cache_root() / "kernels", Path(tempfile.gettempdir()) / "pagedserve"):
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


def main() -> None:
    """`python -m pagedserve_kernels.cpu_ops`: build (or find) the kernels now; `make setup`
    runs it so the first `pagedserve serve` does not compile."""
    import time

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    ops = load_cpu_ops()
    took = time.monotonic() - start
    where = _build_dir() if ops is not None else "unavailable: the plain torch ops serve"
    print(f"pagedserve CPU kernels: {where} ({took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
