"""LoRARequest and the parsing of vLLM's --lora-modules forms (no torch here)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served: the message names the file and tensor or key."""


class LoRAFolderNotFoundError(LoRAError):
    """The adapter folder does not exist (vLLM's load_lora_adapter answers 404)."""


@dataclass(frozen=True)
class LoRARequest:
    """One served adapter. content_hash (of its config and weights) is its identity: the
    prefix cache's salt and the key of its loaded weights, so new weights under an old name
    never meet the old ones' KV blocks."""

    name: str
    lora_int_id: int
    path: str
    content_hash: str
    base_model_name: str | None = None

    @property
    def cache_salt(self) -> bytes:
        return b"lora:" + bytes.fromhex(self.content_hash)


@dataclass(frozen=True)
class LoRAModuleSpec:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModuleSpec:
    """`name=path` or the JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise LoRAError(f"--lora-modules: invalid JSON {text!r} ({e})") from None
        if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
            raise LoRAError(f"--lora-modules: JSON form needs 'name' and 'path', got {text!r}")
        return LoRAModuleSpec(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise LoRAError(f"--lora-modules: expected name=path or JSON, got {text!r}")
    return LoRAModuleSpec(name, path)


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT folder, both present."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAFolderNotFoundError(f"{folder}: no such LoRA adapter folder")
    config, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config.is_file():
        raise LoRAError(f"{config}: missing (a PEFT adapter folder has {ADAPTER_CONFIG})")
    if not weights.is_file():
        has_bin = (folder / "adapter_model.bin").is_file()
        hint = " (convert adapter_model.bin to safetensors)" if has_bin else ""
        raise LoRAError(f"{weights}: missing{hint}")
    return config, weights


def content_hash(path: str | Path) -> str:
    """sha256 over the adapter's config and weight files: its content identity."""
    h = hashlib.sha256()
    for f in adapter_files(path):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
