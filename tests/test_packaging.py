"""Our importable packages live beside the rest of the environment without shadowing it.

transformers 5.25 depends on Hugging Face's `kernels` package and imports it from
transformers.activations (so from every model and from AutoTokenizer); a top-level package of
ours named `kernels` was found first from the repository root and broke every conversion and
parity check (ImportError: cannot import name 'CUDAProperties' from 'kernels').
"""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _our_packages() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("include = "))
    return [p.rstrip("*") for p in ast.literal_eval(line.split("=", 1)[1].strip())]


def test_no_top_level_package_of_ours_is_another_distributions_module():
    ours = _our_packages()
    assert "engine" in ours and "server" in ours
    owners = importlib.metadata.packages_distributions()
    clashes = {
        name: owners[name]
        for name in ours
        if any(dist.lower() != "pagedserve" for dist in owners.get(name, []))
    }
    assert not clashes, f"top-level names also installed by other distributions: {clashes}"


def test_transformers_imports_its_kernels_integration_from_the_repository_root():
    """cwd = the repo root puts our packages first on sys.path, as pytest and `make serve` do."""
    code = (
        "import transformers.integrations.hub_kernels, transformers.activations;"
        "import pagedserve_kernels.cpu_ops; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
