"""The engine's served adapters by name (vLLM's --lora-modules and the load/unload endpoints)."""

from __future__ import annotations

import itertools
import logging

from engine.lora.request import LoRAError, LoRARequest, content_hash, parse_lora_module

logger = logging.getLogger(__name__)


class LoRANotFoundError(LoRAError):
    """Unloading an adapter that is not loaded (HTTP 404)."""


class LoRARegistry:
    """name -> LoRARequest; loading checks the adapter in the runner (LoRAError otherwise)."""

    def __init__(self, config, executor, base_model_name: str) -> None:
        self.executor = executor
        self.base_model_name = base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for text in config.lora_modules:
            spec = parse_lora_module(text)
            self.load(spec.name, spec.path, spec.base_model_name)

    def load(
        self,
        name: str,
        path: str,
        base_model_name: str | None = None,
        load_inplace: bool = True,
    ) -> LoRARequest:
        """Adds (or, load_inplace, replaces: new weights under an old name) an adapter; the
        old one stays with the requests already running under it."""
        if name == self.base_model_name:
            raise LoRAError(f"The lora adapter name '{name}' conflicts with the base model.")
        if not load_inplace and name in self.adapters:
            raise LoRAError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        request = LoRARequest(name, next(self._ids), str(path), content_hash(path), base_model_name)
        self.executor.add_lora(request)  # reads and checks it against the base model
        old = self.adapters.get(name)
        self.adapters[name] = request
        if old is not None and old.content_hash != request.content_hash:
            self.executor.remove_lora(old)  # its running requests keep the old weights
        logger.info("LoRA adapter %s loaded from %s (%s)", name, path, request.content_hash[:12])
        return request

    def unload(self, name: str) -> LoRARequest:
        request = self.adapters.pop(name, None)
        if request is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        self.executor.remove_lora(request)
        return request

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)


def lora_unavailable(name: str, error: LoRAError) -> str:
    """The refusal of a request whose adapter is registered but cannot be read back."""
    return (
        f"The LoRA adapter `{name}` cannot be served: {error}. Restore its folder, load it again "
        "(POST /v1/load_lora_adapter with load_inplace) or unload it; a larger --max-cpu-loras "
        "keeps more adapters in memory."
    )
