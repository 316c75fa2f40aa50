"""A GGUF file (llama.cpp's layout) as a Hugging Face folder: config.json, float32 safetensors,
tokenizer files and generation_config.json, for each architecture in GGUF_ARCHITECTURES; and
the raw blocks of every quantized 2-D tensor, under its Hugging Face name with its type, in
engine/layers/gguf_quant.py's BLOCKS_FILE, from which the loader serves linears packed.

llama.cpp's converter renames tensors (blk.N.attn_q, ...), interleaves the rotary halves of q/k
rows for `llama` only, stores Gemma's norm weights as 1 + weight, stacks MoE experts into one
tensor per projection, and keeps rope scaling either as metadata keys or as factor tensors
(rope_freqs for Llama 3, rope_factors_long/short for Phi-3). convert_gguf undoes each of these so
that the folder equals the Hugging Face checkpoint the file was made from (within the quant error).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"

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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Stacked expert tensors [experts, out, in] -> mlp.experts.E.<proj>.weight
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Tensors that carry rope scaling, read into config.json rather than saved as weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors, tokenizer and generation config for a GGUF file."""
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    family = _family(gguf_path, meta)
    steps = len(reader.tensors) + 3
    with tqdm(total=steps, desc="convert", unit="step", file=sys.stderr) as bar:
        bar.set_description("dequantize weights")
        tensors, extras = convert_tensors(gguf_path, reader, meta, family, bar)
        bar.set_description("write weights")
        save_weights(tensors, out_dir / WEIGHTS_FILE)
        save_blocks(quantized_blocks(gguf_path, reader, meta, family), out_dir)
        bar.update()
        bar.set_description("write config")
        config = {**family.config(meta, tensors, extras), **_token_ids(meta)}
        config.update(torch_dtype=_source_dtype(meta), use_cache=True)
        _write_json(out_dir / "config.json", config)
        _write_json(out_dir / "generation_config.json", generation_config(meta))
        bar.update()
        bar.set_description("convert tokenizer")
        save_tokenizer(gguf_path, out_dir, meta)
        bar.update()


def _source_dtype(meta: Meta) -> str:
    """The dtype the file's weights came from, which `--dtype auto` follows (engine/dtype.py):
    all-F32 files float32, F16 float16, BF16 and quantized files bfloat16 (their publishers
    quantize bf16 checkpoints). The weights themselves are written in float32 either way."""
    file_type = meta.get("general.file_type")  # llama.cpp's LLAMA_FTYPE: 0 F32, 1 F16, 32 BF16
    if file_type is None:
        return "float32"
    return {0: "float32", 1: "float16"}.get(file_type, "bfloat16")


def _family(gguf_path: Path, meta: Meta) -> Family:
    arch = meta.architecture
    if arch not in FAMILIES:
        names = ", ".join(GGUF_ARCHITECTURES)
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (supported: {names})"
        )
    return FAMILIES[arch]


def read_metadata(reader: Any) -> Meta:
    # Token tables are large and read separately by the tokenizer conversion.
    skip = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    )
    return Meta({key: f.contents() for key, f in reader.fields.items() if key not in skip})


def convert_tensors(
    gguf_path: Path, reader: Any, meta: Meta, family: Family, bar: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF name -> float32 array, rope tensor name -> array) for every tensor of the file."""
    from gguf.quants import dequantize

    heads = int(meta.arch("attention.head_count"))
    kv_heads = int(meta.arch("attention.head_count_kv", heads))
    out: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for tensor in reader.tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            msg = f"{gguf_path.name}: tensor {tensor.name} has quant type {tensor.tensor_type.name}"
            raise ValueError(f"{msg}, which gguf-py cannot dequantize") from None
        # GGUF stores dims fastest-first; numpy data is already row-major (out, in).
        array = array.astype("float32", copy=False).reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
        bar.update()
        if tensor.name in _ROPE_TENSORS:
            extras[tensor.name] = array
            continue
        if family.permute_rotary and ".attn_q." in tensor.name:
            array = _unpermute_rotary(array, heads)
        elif family.permute_rotary and ".attn_k." in tensor.name:
            array = _unpermute_rotary(array, kv_heads)
        if family.norm_offset and tensor.name.endswith("norm.weight"):
            array = array - family.norm_offset
        parts = tensor.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES:
            proj = _EXPERT_NAMES[parts[2]]
            for e, expert in enumerate(array):
                out[f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"] = expert
            continue
        out[_hf_name(gguf_path, meta, family, tensor.name)] = array
    return out, extras


def quantized_blocks(
    gguf_path: Path, reader: Any, meta: Meta, family: Family
) -> dict[str, tuple[str, Any]]:
    """HF name -> (GGUF type name, raw blocks uint8 [rows, row_bytes]) for every quantized 2-D
    tensor (rows permuted as convert_tensors permutes the dequantized ones)."""
    import numpy as np

    heads = int(meta.arch("attention.head_count"))
    kv_heads = int(meta.arch("attention.head_count_kv", heads))
    out: dict[str, tuple[str, Any]] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        if qtype in ("F32", "F16", "BF16", "F64") or len(tensor.shape) != 2:
            continue
        if tensor.name in _ROPE_TENSORS:
            continue
        rows = int(tensor.shape[1])
        raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        if family.permute_rotary and ".attn_q." in tensor.name:
            raw = _unpermute_rotary(raw, heads)
        elif family.permute_rotary and ".attn_k." in tensor.name:
            raw = _unpermute_rotary(raw, kv_heads)
        out[_hf_name(gguf_path, meta, family, tensor.name)] = (qtype, raw)
    return out


def save_blocks(blocks: dict[str, tuple[str, Any]], out_dir: Path) -> None:
    """The quantized tensors' raw blocks (safetensors format, types in the metadata), if any."""
    from safetensors.numpy import save_file

    from engine.layers.gguf_quant import BLOCKS_FILE

    if not blocks:
        return
    import numpy as np

    arrays = {name: np.ascontiguousarray(raw) for name, (_, raw) in blocks.items()}
    save_file(arrays, str(out_dir / BLOCKS_FILE), metadata={n: t for n, (t, _) in blocks.items()})


def _hf_name(gguf_path: Path, meta: Meta, family: Family, gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in family.layer_names:
        return f"model.layers.{parts[1]}.{family.layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    arch = meta.architecture
    raise ValueError(f"{gguf_path.name}: tensor {gguf_name!r} is not known for architecture {arch}")


def _unpermute_rotary(array: Any, heads: int) -> Any:
    # llama.cpp interleaves each head's rotary pairs; HF keeps the two halves apart.
    rows = array.shape[0]
    pairs = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return pairs.swapaxes(1, 2).reshape(array.shape).copy()


def save_weights(tensors: dict[str, Any], path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    # transformers only loads safetensors whose metadata says format=pt.
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})


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
    "qwen3": Family(_qwen3_config),
    "qwen3moe": Family(_qwen3moe_config),
    "phi3": Family(_phi3_config, layer_names=_PHI3_LAYER_NAMES),
    "gemma2": Family(_gemma2_config, layer_names=_GEMMA_LAYER_NAMES, norm_offset=1.0),
    "gemma3": Family(_gemma3_config, layer_names=_GEMMA_LAYER_NAMES, norm_offset=1.0),
}
GGUF_ARCHITECTURES = tuple(sorted(FAMILIES))


# ---- token ids, generation config, tokenizer -------------------------------------------------
def _token_ids(meta: Meta) -> dict[str, Any]:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {hf: meta.get(f"tokenizer.ggml.{g}_token_id") for hf, g in keys.items()}


def eos_token_ids(meta: Meta) -> list[int]:
    """Every id that ends generation: EOS, end-of-turn and end-of-message, as llama.cpp stops."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def generation_config(meta: Meta) -> dict[str, Any]:
    out = {k: v for k, v in _token_ids(meta).items() if v is not None}
    eos = eos_token_ids(meta)
    if eos:
        out["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return out


def save_tokenizer(gguf_path: Path, out_dir: Path, meta: Meta) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
    tokenizer.save_pretrained(out_dir)
    _drop_tokens_beyond_file(out_dir, _num_file_tokens(gguf_path))
    flags = {
        flag: meta.get(f"tokenizer.ggml.{flag}")
        for flag in ("add_bos_token", "add_eos_token")
        if meta.get(f"tokenizer.ggml.{flag}") is not None
    }
    if flags:
        _set_special_token_insertion(out_dir / "tokenizer.json", meta, flags)
    max_length = int(meta.arch("context_length", 2048))
    _tidy_tokenizer_config(
        out_dir / "tokenizer_config.json", tokenizer.chat_template, max_length, flags
    )
    if tokenizer.chat_template:
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def _num_file_tokens(gguf_path: Path) -> int:
    import gguf

    return len(gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].data)


def _drop_tokens_beyond_file(out_dir: Path, num_tokens: int) -> None:
    """Added tokens past the file's token list go: transformers' Gemma tokenizer class adds a
    <mask> of its own when the file has none, and the embedding has no row for it."""
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    added = data.get("added_tokens", [])
    extra = {t["content"] for t in added if t["id"] >= num_tokens}
    if not extra:
        return
    data["added_tokens"] = [t for t in added if t["id"] < num_tokens]
    _write_json(path, data)
    cfg_path = out_dir / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text())
    decoder = config.get("added_tokens_decoder", {})
    config["added_tokens_decoder"] = {i: t for i, t in decoder.items() if int(i) < num_tokens}
    for key, value in list(config.items()):
        if key.endswith("_token") and value in extra:
            config.pop(key)
    _write_json(cfg_path, config)


def _set_special_token_insertion(path: Path, meta: Meta, flags: dict[str, bool]) -> None:
    """Encoding prepends BOS (appends EOS) exactly when the file says so, as llama.cpp does.

    Whether transformers' GGUF tokenizer honours tokenizer.ggml.add_bos_token depends on its
    version and tokenizer class (4.x drops the flag); written into tokenizer.json, every reader
    of the folder agrees. Gemma without its <bos> degenerates. Chat prompts are encoded without
    special tokens (the template writes <bos> itself), so they do not get a second one.
    """
    data = json.loads(path.read_text())
    vocab = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    model_vocab = data.get("model", {}).get("vocab")
    if isinstance(model_vocab, dict):
        reverse = {i: t for t, i in model_vocab.items()}
    elif isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
        reverse = dict(enumerate(p[0] for p in model_vocab))
    else:
        reverse = {}
    specials: dict[str, dict] = {}
    single: list[dict] = []
    pair: list[dict] = []
    tail_single: list[dict] = []
    tail_pair: list[dict] = []
    for flag, key, head in (("add_bos_token", "bos", True), ("add_eos_token", "eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not flags.get(flag) or token_id is None:
            continue
        token = vocab.get(int(token_id)) or reverse.get(int(token_id))
        if token is None:
            raise ValueError(f"tokenizer.ggml.{key}_token_id {token_id} is not in the vocabulary")
        specials[token] = {"id": token, "ids": [int(token_id)], "tokens": [token]}
        entry = [{"SpecialToken": {"id": token, "type_id": 0}}]
        (single if head else tail_single).extend(entry)
        (pair if head else tail_pair).extend(entry)
    template = {
        "type": "TemplateProcessing",
        "single": single + [{"Sequence": {"id": "A", "type_id": 0}}] + tail_single,
        "pair": pair
        + [{"Sequence": {"id": "A", "type_id": 0}}]
        + tail_pair
        + [{"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": specials,
    }
    # Keep a byte-level post-processor (offsets) and replace whatever inserted special tokens.
    old = data.get("post_processor")
    kept = [p for p in _post_processors(old) if p.get("type") != "TemplateProcessing"]
    procs = kept + ([template] if specials else [])
    data["post_processor"] = (
        None
        if not procs
        else procs[0]
        if len(procs) == 1
        else {"type": "Sequence", "processors": procs}
    )
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def _post_processors(proc: dict | None) -> list[dict]:
    if not proc:
        return []
    if proc.get("type") == "Sequence":
        return [p for sub in proc["processors"] for p in _post_processors(sub)]
    return [proc]


def _smollm_pre_tokenizer() -> Any:
    from tokenizers import pre_tokenizers

    # transformers falls back to plain GPT-2 splitting for "smollm"; SmolLM (and llama.cpp's
    # smollm mode) split every digit apart first, which changes how runs like "\t\t0" merge.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _tidy_tokenizer_config(
    path: Path, chat_template: str | None, max_length: int, flags: dict[str, bool]
) -> None:
    config = json.loads(path.read_text())
    # Load-time options leak into the saved file; they mean nothing to a later reader.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    # PreTrainedTokenizerFast loads in transformers 4.x and 5.x alike (5.x aliases it).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    config.update({k: bool(v) for k, v in flags.items()})
    if chat_template:
        # Readers that only look at tokenizer_config.json (older tooling) still find it.
        config["chat_template"] = chat_template
    _write_json(path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
