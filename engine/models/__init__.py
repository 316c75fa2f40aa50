"""Model implementations that run on one flattened token batch over a paged KV cache.

MODEL_REGISTRY maps a Hugging Face architecture name (config.architectures[0]) to its class.
A family file composes engine/layers/ and says only how it differs from Llama; every class is
built as cls(hf_config, backend) and offers load_weights(state) -> (missing, unexpected),
forward(input_ids, positions, meta, kv_caches) -> hidden and compute_logits(hidden), with
Hugging Face's module names (model.embed_tokens, model.layers, model.norm, lm_head).
"""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {"LlamaForCausalLM": LlamaForCausalLM}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def get_model_class(hf_config) -> type[nn.Module]:
    """The class for hf_config's architecture (Llama when the config names none)."""
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if archs[0] not in MODEL_REGISTRY:
        raise ValueError(f"architecture {archs[0]} is not supported ({SUPPORTED_ARCHITECTURES})")
    return MODEL_REGISTRY[archs[0]]
