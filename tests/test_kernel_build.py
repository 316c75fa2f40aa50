"""The CPU kernels' build cache: a build without its completion marker (killed mid-compile or
mid-link) is never reused, `make setup` builds ahead, and a start that must compile says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedserve_kernels import cpu_ops

ROOT = Path(__file__).resolve().parent.parent


def test_a_build_without_its_marker_is_cleared(tmp_path):
    (tmp_path / ".build.flock").touch()
    (tmp_path / "pagedserve_cpu_ops.so").write_bytes(b"\x7fELF half")
    (tmp_path / "build.ninja").write_text("rule cxx\n")
    (tmp_path / "sub").mkdir()
    assert not cpu_ops.is_built(tmp_path)
    cpu_ops._clear_partial_build(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.flock"]


def test_the_marker_must_name_this_build(tmp_path):
    (tmp_path / cpu_ops.BUILD_MARKER).write_text("0123456789abcdef\n")  # another key
    assert not cpu_ops.is_built(tmp_path)
    (tmp_path / cpu_ops.BUILD_MARKER).write_text(cpu_ops.build_key() + "\n")
    assert cpu_ops.is_built(tmp_path)


def test_a_loaded_build_is_marked():
    if cpu_ops.load_cpu_ops() is None:  # no compiler here: nothing is marked
        assert not cpu_ops.is_built()
    else:
        assert cpu_ops.is_built()


def test_setup_builds_the_kernels_ahead():
    makefile = (ROOT / "Makefile").read_text()
    setup = makefile[makefile.index("$(STAMP):") : makefile.index("touch $(STAMP)")]
    assert "-m pagedserve_kernels.cpu_ops" in setup
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve_kernels.cpu_ops"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    assert out.stdout.startswith("pagedserve CPU kernels: ")


def test_loading_names_each_stage_to_health(monkeypatch):
    """build_server tells /health what it is doing: the model files, then (when the build is
    missing) the kernel compile with its usual time, then the weights and KV cache."""
    import engine.model_loader.loader as loader
    from engine.config import EngineConfig
    from server import cli

    stages: list[str] = []
    monkeypatch.setattr(loader, "resolve_model", lambda *model: stages.append("resolved"))
    monkeypatch.setattr(cpu_ops, "is_built", lambda build_dir=None: False)
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: stages.append("loaded"))
    monkeypatch.setattr(cpu_ops, "cpu_kernels_enabled", lambda: True)
    cli._prepare(EngineConfig(device="cpu"), stages.append)
    assert stages[0].startswith("reading the model") and stages[1] == "resolved"
    assert stages[2].startswith("compiling the CPU kernels (about 35 s")
    assert stages[3:] == ["loaded", "loading the weights and allocating the KV cache"]
