"""Mistral: Llama's decoder. Its checkpoints differ only in sliding_window, which must be null
here (LlamaForCausalLM.check_config refuses a set window: sliding-window attention is not
implemented)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
