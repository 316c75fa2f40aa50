"""Model implementations that run on one flattened token batch over a paged KV cache."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
