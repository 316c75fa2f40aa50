"""Layers that model files compose; each picks its implementation once, at load (base.py).

    model = LlamaForCausalLM(cfg, backend)   # every layer runs its torch oracle
    ...load weights, .to(device, dtype)...
    select_impls(model, ops)                 # ops: the CPU kernels, or None: oracles stay
"""

from __future__ import annotations

from engine.layers.activation import GeluAndMul, SiluAndMul
from engine.layers.attention import Attention, GroupedAttentionMetadata, KVCache, layer_windows
from engine.layers.base import CPU, NATIVE, KernelLayer, select_impls
from engine.layers.experts import Experts
from engine.layers.linear import PACKED, Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rope
from engine.layers.rotary_scaling import ROPE_TYPES, check_rope, rope_from_config

__all__ = [
    "CPU",
    "NATIVE",
    "PACKED",
    "ROPE_TYPES",
    "Attention",
    "Experts",
    "GeluAndMul",
    "GroupedAttentionMetadata",
    "KVCache",
    "KernelLayer",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rope",
    "check_rope",
    "layer_windows",
    "rope_from_config",
    "select_impls",
]
