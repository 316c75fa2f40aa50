"""Phi-3: Llama's decoder with q/k/v and gate/up stored fused in the checkpoint (qkv_proj,
gate_up_proj: the layout LlamaForCausalLM already runs, so they load as they are) and longrope
scaling (engine/layers/rotary_scaling.py)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # PEFT adapters name Hugging Face's modules, fused here too: their B spans the whole linear
    # (engine/lora/manager.py splits its rows across q/k/v and gate/up)
    lora_fused_targets = ("qkv_proj", "gate_up_proj")
