"""Model implementations that run on one flattened token batch over a paged KV cache.

MODEL_REGISTRY maps a Hugging Face architecture name (config.architectures[0]) to its class.
A family file composes engine/layers/ and says only how it differs from Llama; every class is
built as cls(hf_config, backend) and offers load_weights(state) -> (missing, unexpected),
forward(input_ids, positions, meta, kv_caches) -> hidden and compute_logits(hidden), with
Hugging Face's module names (model.embed_tokens, model.layers, model.norm, lm_head), and
check_config(hf_config, max_model_len) for what the config asks and the class does not do.
"""

from __future__ import annotations

from torch import nn

from engine.layers import check_rope
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import llava_class
from engine.models.mistral import MistralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # vision-language with its own image side (LLaVA-style ones: MULTIMODAL_REGISTRY)
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}
# vision-language architectures: a factory of the class from the text family's
MULTIMODAL_REGISTRY = {"LlavaForConditionalGeneration": llava_class}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY) + tuple(MULTIMODAL_REGISTRY)


def get_model_class(hf_config) -> type[nn.Module]:
    """The class for hf_config's architecture (Llama when the config names none)."""
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if archs[0] in MULTIMODAL_REGISTRY:
        text = hf_config.get_text_config()
        return MULTIMODAL_REGISTRY[archs[0]](get_model_class(text))
    if archs[0] not in MODEL_REGISTRY:
        names = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"architecture {archs[0]!r} is not supported (supported: {names})")
    return MODEL_REGISTRY[archs[0]]


def check_model_config(hf_config, max_model_len: int) -> None:
    """Start-up check, before any weight is read: ValueError (one line) for an architecture, a
    rope type or an attention variant this engine does not serve."""
    get_model_class(hf_config).check_config(hf_config, max_model_len)
    check_rope(hf_config.get_text_config())
