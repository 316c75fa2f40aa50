"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (none on o_proj)."""

from __future__ import annotations

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def biases(self, cfg) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer
