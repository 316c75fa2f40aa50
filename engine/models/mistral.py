"""Mistral: Llama's decoder. A set sliding_window makes every layer attend to the last
sliding_window tokens (Mistral 7B v0.1: 4096); the window reaches each layer's Attention through
LlamaForCausalLM (engine/layers/attention.py layer_windows)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
