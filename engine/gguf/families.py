"""How each GGUF architecture maps to its Hugging Face family: tensor names, config.json, and the
fix-ups llama.cpp's converter applied (rotary interleave for `llama`, Gemma's 1 + weight norms).

One `Family` per architecture in FAMILIES; a new family adds its config function and entry here
and its model file in engine/models/.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# GGUF per-layer tensor names (after "blk.N.") to Hugging Face names, shared by every family.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}


# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-MLP norm there.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# Phi-3 keeps gate and up fused; llama.cpp stores the fused tensor as ffn_up.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}


class Meta(dict):
    """The file's metadata; arch(key) reads "<architecture>.<key>"."""

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps to Hugging Face."""

    config: Callable[[Meta, dict[str, Any], dict[str, Any]], dict[str, Any]]
    layer_names: dict[str, str] = field(default_factory=lambda: _LAYER_NAMES)
    permute_rotary: bool = False  # llama.cpp interleaves q/k rotary halves for `llama` only
    norm_offset: float = 0.0  # Gemma norms are stored as offset + weight


# ---- config.json per family ------------------------------------------------------------------
def _base_config(meta: Meta, tensors: dict[str, Any], arch: str, model_type: str) -> dict:
    hidden = int(meta.arch("embedding_length"))
    heads = int(meta.arch("attention.head_count"))
    head_dim = meta.arch("attention.key_length") or meta.arch("rope.dimension_count")
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.arch("context_length", 2048)),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.arch("rope.freq_base", 10000.0)),
        # No separate output tensor in the GGUF means the head reuses the embedding.
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }


def _with_rope(config: dict, scaling: dict | None) -> dict:
    # rope_theta and rope_scaling for readers of the classic layout, rope_parameters for
    # transformers>=5; all three say the same.
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": config["rope_theta"]}
    if scaling:
        config["rope_scaling"] = dict(scaling)
    config["rope_parameters"] = params
    return config


def _metadata_rope_scaling(meta: Meta) -> dict | None:
    """linear and yarn scaling as llama.cpp writes them into rope.scaling.* keys."""
    kind = meta.arch("rope.scaling.type")
    factor = meta.arch("rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        orig = meta.arch("rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.arch(f"rope.scaling.{key}") is not None:
                out[hf_key] = float(meta.arch(f"rope.scaling.{key}"))
        return out
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _llama_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    # llama.cpp writes Mistral checkpoints as `llama`; general.name tells them apart. Mistral
    # without a window computes what Llama computes (llama.cpp serves it so).
    mistral = "mistral" in str(meta.get("general.name", "")).lower()
    arch, model_type = (
        ("MistralForCausalLM", "mistral") if mistral else ("LlamaForCausalLM", "llama")
    )
    config = _base_config(meta, tensors, arch, model_type)
    config.update(
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        mlp_bias=False,
    )
    if mistral:
        config["sliding_window"] = None
    scaling = _metadata_rope_scaling(meta)
    if "rope_freqs.weight" in extras:
        scaling = llama3_scaling(
            extras["rope_freqs.weight"], config["rope_theta"], config["head_dim"]
        )
    return _with_rope(config, scaling)


def llama3_scaling(freqs: Any, theta: float, head_dim: int) -> dict | None:
    """Llama 3.x rope scaling parameters that reproduce llama.cpp's rope_freqs tensor.

    rope_freqs holds one divisor per frequency: 1 above the high-frequency wavelength threshold,
    `factor` below the low one, a blend between. Only factor and the two thresholds shape the
    result, so low_freq_factor is fixed at 1 (every Llama 3.x config has it) and the rest solved.
    """
    import numpy as np

    freqs = np.asarray(freqs, dtype=np.float64)
    factor = float(freqs.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    # freq = 1 / ((1 - s) / factor + s) for the blend weight s = (old / wavelen - lf) / (hf - lf)
    s = (1 / freqs - 1 / factor) / (1 - 1 / factor)
    medium = (s > 1e-4) & (s < 1 - 1e-4)
    if medium.sum() >= 2:
        slope, icept = np.polyfit(1 / wavelen[medium], s[medium], 1)  # s = slope/w + icept
        old, high = -slope / icept, 1 - 1 / icept
    else:  # no blend to fit: put each threshold between the wavelengths it separates
        low_w = math.sqrt(
            wavelen[freqs < factor - 1e-6].max() * wavelen[freqs >= factor - 1e-6].min()
        )
        high_w = math.sqrt(wavelen[freqs <= 1 + 1e-6].max() * wavelen[freqs > 1 + 1e-6].min())
        old, high = low_w, low_w / high_w
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(round(old)),
    }
    if not np.allclose(_llama3_divisors(params, inv), freqs, rtol=1e-4, atol=1e-6):
        raise ValueError("GGUF tensor rope_freqs.weight is not a Llama 3 rope scaling")
    return params


def _llama3_divisors(p: dict, inv: Any) -> Any:
    # transformers' llama3 frequencies, as divisors of the unscaled ones.
    import numpy as np

    old, lf, hf, factor = (
        p["original_max_position_embeddings"],
        p["low_freq_factor"],
        p["high_freq_factor"],
        p["factor"],
    )
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lf, inv / factor, inv)
    smooth = (old / wavelen - lf) / (hf - lf)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hf) & ~(wavelen > old / lf)
    return inv / np.where(medium, blended, scaled)


def _qwen2_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _base_config(meta, tensors, "Qwen2ForCausalLM", "qwen2")
    config.update(use_sliding_window=False, sliding_window=None)
    return _with_rope(config, _metadata_rope_scaling(meta))


def _qwen2vl_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    """llama.cpp's `qwen2vl`: the text side of Qwen2-VL / Qwen2.5-VL, M-RoPE sections in
    rope.dimension_sections ([t, h, w, 0]). Alone it serves as Qwen2 (text positions are equal on
    all three axes, where M-RoPE is plain RoPE); with a Qwen-VL mmproj the sections go into the
    joined model's text_config (engine/gguf/mmproj_qwen2_5_vl.py)."""
    config = _qwen2_config(meta, tensors, extras)
    sections = [int(s) for s in meta.arch("rope.dimension_sections") or []]
    if sum(sections) != config["head_dim"] // 2:
        raise ValueError(
            f"GGUF key qwen2vl.rope.dimension_sections {sections} does not split the "
            f"{config['head_dim'] // 2} rotary frequencies of a {config['head_dim']}-wide head"
        )
    config["mrope_section"] = sections[:3]
    return config


def _qwen3_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _base_config(meta, tensors, "Qwen3ForCausalLM", "qwen3")
    config.update(
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        use_sliding_window=False,
        sliding_window=None,
    )
    return _with_rope(config, _metadata_rope_scaling(meta))


def _qwen3moe_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _base_config(meta, tensors, "Qwen3MoeForCausalLM", "qwen3_moe")
    layers = config["num_hidden_layers"]
    sparse = [f"model.layers.{i}.mlp.gate.weight" in tensors for i in range(layers)]
    first = sparse.index(True) if any(sparse) else None
    moe_ff = meta.arch("expert_feed_forward_length")
    if moe_ff is None and first is not None:
        moe_ff = tensors[f"model.layers.{first}.mlp.experts.0.gate_proj.weight"].shape[0]
    config.update(
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        num_experts=int(meta.arch("expert_count", 0)),
        num_experts_per_tok=int(meta.arch("expert_used_count", 0)),
        moe_intermediate_size=int(moe_ff or 0),
        decoder_sparse_step=1,
        # layers with a dense MLP (no router tensor) are transformers' mlp_only_layers
        mlp_only_layers=[i for i, s in enumerate(sparse) if not s],
        # llama.cpp renormalises the top-k weights of qwen3moe unless the file says otherwise
        norm_topk_prob=bool(meta.arch("expert_weights_norm", True)),
        use_sliding_window=False,
        sliding_window=None,
    )
    return _with_rope(config, _metadata_rope_scaling(meta))


def _phi3_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _base_config(meta, tensors, "Phi3ForCausalLM", "phi3")
    # Phi-3 may rotate only part of each head; rope.dimension_count is the rotated part.
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(meta.arch("rope.dimension_count", config["head_dim"]))
    if rotary != config["head_dim"]:
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    window = meta.arch("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    orig = meta.arch("rope.scaling.original_context_length")
    if orig:
        config["original_max_position_embeddings"] = int(orig)
    scaling = _metadata_rope_scaling(meta)
    if "rope_factors_long.weight" in extras:
        scaling = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in extras["rope_factors_long.weight"]],
            "short_factor": [float(x) for x in extras["rope_factors_short.weight"]],
        }
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
    return _with_rope(config, scaling)


def _gemma_common(meta: Meta, tensors: dict[str, Any], arch: str, model_type: str) -> dict:
    config = _base_config(meta, tensors, arch, model_type)
    config["hidden_activation"] = config["hidden_act"] = "gelu_pytorch_tanh"
    config["rms_norm_eps"] = float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6))
    config["attention_bias"] = False
    window = meta.arch("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    config["query_pre_attn_scalar"] = _query_pre_attn_scalar(meta, config)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.arch(key)
        config[key] = float(value) if value else None
    return config


def _query_pre_attn_scalar(meta: Meta, config: dict) -> float:
    scale = meta.arch("attention.scale")
    if scale:
        return 1.0 / float(scale) ** 2
    # llama.cpp's rule when the file has no scale: hidden/heads for the 27B models (46 Gemma 2
    # layers, 62 Gemma 3 layers), head_dim for every other size.
    big = {"gemma2": 46, "gemma3": 62}.get(meta.architecture)
    if config["num_hidden_layers"] == big:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _layer_types(meta: Meta, layers: int, default_pattern: int) -> list[str]:
    """Sliding or full attention per layer: the file's sliding_window_pattern (a flag per layer
    or a period) or llama.cpp's built-in period (every n-th layer full)."""
    pattern = meta.arch("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern) if isinstance(pattern, (int, float)) and pattern else default_pattern
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def _gemma2_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _gemma_common(meta, tensors, "Gemma2ForCausalLM", "gemma2")
    config["layer_types"] = _layer_types(meta, config["num_hidden_layers"], 2)
    return _with_rope(config, _metadata_rope_scaling(meta))


def _gemma3_config(meta: Meta, tensors: dict[str, Any], extras: dict[str, Any]) -> dict:
    config = _gemma_common(meta, tensors, "Gemma3ForCausalLM", "gemma3_text")
    config["layer_types"] = _layer_types(meta, config["num_hidden_layers"], 6)
    # llama.cpp's local-layer base when the file does not carry one.
    local = float(meta.arch("rope.freq_base_swa", 10000.0))
    config["rope_local_base_freq"] = local
    scaling = _metadata_rope_scaling(meta)  # the global layers' scaling (Gemma 3 4B and up)
    if scaling:
        config["rope_scaling"] = dict(scaling)
    # transformers 5 keys rope parameters by layer type for Gemma 3.
    config["rope_parameters"] = {
        "full_attention": {
            "rope_type": "default",
            **(scaling or {}),
            "rope_theta": config["rope_theta"],
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    return config


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama_config, permute_rotary=True),
    "qwen2": Family(_qwen2_config),
    "qwen2vl": Family(_qwen2vl_config),
    "qwen3": Family(_qwen3_config),
    "qwen3moe": Family(_qwen3moe_config),
    "phi3": Family(_phi3_config, layer_names=_PHI3_LAYER_NAMES),
    "gemma2": Family(_gemma2_config, layer_names=_GEMMA_LAYER_NAMES, norm_offset=1.0),
    "gemma3": Family(_gemma3_config, layer_names=_GEMMA_LAYER_NAMES, norm_offset=1.0),
}


GGUF_ARCHITECTURES = tuple(sorted(FAMILIES))
