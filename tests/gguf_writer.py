"""GGUF files written as llama.cpp's converter writes them, for the tests and bench/make_gguf.py:
tensor names from gguf-py's own name map, llama q/k rows in its interleaved rotary order, the
hyperparameters under `{arch}.*`, and the file in gguf-py's write order. Imports no engine code
(engine/gguf/convert.py is what these files test); bench/make_gguf.py puts tests/ on sys.path.

`write_gguf` writes a test folder (the byte tokenizer of tests/conftest.py, any family, optional
quantization); the building blocks above it serve bench/make_gguf.py's real-tokenizer files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def permute_rotary(weight, heads: int):
    """llama.cpp's `llama` layout interleaves the two rotary halves of each head's q/k rows;
    engine/gguf/convert.py's _unpermute_rotary is the inverse."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tensor_names(arch: str, num_layers: int):
    """HF tensor name -> GGUF name, from gguf-py's map for `arch` (ValueError for a tensor it
    has no name for). Qwen3-MoE's map has no dense MLP (llama.cpp has no mlp_only_layers), so
    llama's map names those."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, num_layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)

    def gguf_name(hf_name: str) -> str:
        stem, _, kind = hf_name.rpartition(".")
        name = names.get_name(stem) or (arch == "qwen3moe" and dense.get_name(stem))
        if not name:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        return f"{name}.{kind}"

    return gguf_name


def add_hparams(writer, config: dict[str, Any]) -> None:
    """The `{arch}.*` keys every family has, from an HF config dict; rope keys are the caller's."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))


def write_file(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- a test folder as a GGUF ------------------------------------------------------------------
def write_gguf(
    model_dir: Path,
    path: Path,
    arch: str,
    name: str,
    qtype=None,
    add_bos: bool | None = None,
    tokenizer=None,
) -> dict:
    """Write `model_dir` (saved with conftest's byte tokenizer, or `tokenizer`: its special
    added tokens, such as LLaVA's <image>, stored as CONTROL tokens as llama.cpp's converter
    does) as a GGUF of `arch`, matrices quantized to `qtype`; returns {GGUF tensor name: (HF
    names, qtype)}."""
    import gguf
    import numpy as np
    from conftest import CHAT_TEMPLATE, build_byte_tokenizer
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    tokenizer = tokenizer or build_byte_tokenizer()
    gguf_name = tensor_names(arch, cfg.num_hidden_layers)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    add_hparams(w, cfg.to_dict())
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    elif kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], "float32"))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], "float32"))
    if rope.get("mrope_section"):  # qwen2vl: [t, h, w] padded to 4, as the converter does
        sections = list(rope["mrope_section"])
        w.add_rope_dimension_sections((sections + [0] * 4)[:4])
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    # the 3 special tokens, the 256 bytes, then any special token added on top (CONTROL)
    w.add_token_types([1 if 3 <= i < 259 else 3 for i in range(len(tokenizer))])
    # No merges: transformers then derives them from scores, which for bytes alone is none.
    w.add_token_scores([0.0] * len(tokenizer))
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_eot_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    layout: dict[str, tuple[list[str], object]] = {}
    experts: dict[str, list[tuple[int, str]]] = {}
    for hf_name, weight in state.items():
        stem, kind_ = hf_name.rsplit(".", 1)
        parts = stem.split(".")
        if len(parts) == 7 and parts[4] == "experts":  # model.layers.L.mlp.experts.E.proj
            proj = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[parts[6]]
            experts.setdefault(f"blk.{parts[2]}.ffn_{proj}_exps.{kind_}", []).append(
                (int(parts[5]), hf_name)
            )
            continue
        if arch == "llama" and stem.endswith("q_proj"):
            weight = permute_rotary(weight, heads)
        elif arch == "llama" and stem.endswith("k_proj"):
            weight = permute_rotary(weight, kv_heads)
        if arch.startswith("gemma") and stem.endswith("norm"):
            weight = weight + 1.0  # llama.cpp stores Gemma's (1 + weight) factor
        target = gguf_name(hf_name)
        layout[target] = _add(w, target, weight, qtype), [hf_name]
    for target, members in experts.items():
        members.sort()
        stacked = np.stack([state[n] for _, n in members])
        layout[target] = _add(w, target, stacked, qtype), [n for _, n in members]
    write_file(w)
    return {k: (names_, q) for k, (q, names_) in layout.items()}


def llama3_rope_freqs(cfg):
    """The per-frequency divisors llama.cpp stores as rope_freqs, from transformers' own llama3
    frequencies (an independent computation of what the converter must invert)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = cfg.rope_parameters["rope_theta"]
    dim = cfg.head_dim
    default = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (default / scaled).numpy().astype("float32")


def _add(writer, name: str, weight, qtype):
    """Add a tensor, quantized to qtype for matrices as llama.cpp does (vectors stay F32)."""
    import gguf

    if qtype is None or weight.ndim < 2:
        writer.add_tensor(name, weight)
        return gguf.GGMLQuantizationType.F32
    if qtype in K_SCALE_OFFSETS:  # gguf-py cannot quantize K types: store random blocks
        writer.add_tensor(name, _random_k_blocks(name, weight.shape, qtype), raw_dtype=qtype)
        return qtype
    writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    return qtype


def _k_offsets():
    import gguf

    t = gguf.GGMLQuantizationType
    # byte offsets of the float16 super-block scales (d, and dmin where the type has one)
    return {t.Q4_K: (0, 2), t.Q5_K: (0, 2), t.Q6_K: (208,)}


K_SCALE_OFFSETS = _k_offsets()


def _random_k_blocks(name: str, shape, qtype):
    """Random but finite K-quant blocks for a [rows, cols] matrix (cols a multiple of 256)."""
    import zlib

    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        blocks[..., offset : offset + 2] = scale
    return blocks.reshape(*shape[:-1], -1)


# ---- llama.cpp's mmproj file of a LLaVA model -------------------------------------------------
def _legacy_clip_name(hf_name: str) -> str:
    """tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py's tensor names (the converter
    of LLaVA 1.5 style mmproj files, projector type mlp): linear_1/linear_2 -> mm.0/mm.2, the
    tower's names shortened, and its fc1 stored as ffn_down, fc2 as ffn_up."""
    if hf_name.startswith("multi_modal_projector."):
        return (
            hf_name.replace("multi_modal_projector", "mm")
            .replace("linear_1", "0")
            .replace("linear_2", "2")
        )
    name = hf_name.replace("vision_model", "v").replace("encoder.layers", "blk")
    name = name.replace("embeddings.", "").replace("_proj", "").replace("self_attn.", "attn_")
    name = name.replace("layer_norm", "ln").replace("layernorm", "ln")
    name = name.replace("mlp.fc1", "ffn_down").replace("mlp.fc2", "ffn_up")
    return name.replace("embedding", "embd").replace("layrnorm", "ln")


def write_llava_mmproj(model_dir: Path, path: Path, swap_ffn: bool = True, **overrides) -> None:
    """The image side of a transformers LLaVA folder (CLIP tower) as llama.cpp's legacy
    converter writes it with --use-f32: arch `clip`, the clip.vision.* keys, the tower cut
    after its deepest feature layer (post_layernorm dropped), the 4-D patch embedding in F16.
    swap_ffn=False names fc1 ffn_up as gguf-py's own V_ENC_FFN_UP map does. overrides replace
    metadata values (key -> value) to make broken files."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoImageProcessor

    cfg = AutoConfig.from_pretrained(model_dir)
    vcfg = cfg.vision_config
    processor = AutoImageProcessor.from_pretrained(model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    n = vcfg.num_hidden_layers
    feature = cfg.vision_feature_layer
    layers = [
        i if i >= 0 else n + i + 1 for i in ([feature] if isinstance(feature, int) else feature)
    ]
    w = gguf.GGUFWriter(str(path), "clip")
    keys = {
        "clip.has_text_encoder": False,
        "clip.has_vision_encoder": True,
        "clip.has_llava_projector": True,
        "general.file_type": 0,
        "general.name": "tiny-llava",
        "general.description": "image encoder for LLaVA",
        "clip.projector_type": "mlp",
        "clip.vision.image_size": vcfg.image_size,
        "clip.vision.patch_size": vcfg.patch_size,
        "clip.vision.embedding_length": vcfg.hidden_size,
        "clip.vision.feed_forward_length": vcfg.intermediate_size,
        "clip.vision.projection_dim": getattr(vcfg, "projection_dim", 0),
        "clip.vision.attention.head_count": vcfg.num_attention_heads,
        "clip.vision.attention.layer_norm_epsilon": float(vcfg.layer_norm_eps),
        "clip.vision.block_count": max(layers),
        "clip.vision.feature_layer": layers,
        "clip.vision.image_mean": [float(x) for x in processor.image_mean],
        "clip.vision.image_std": [float(x) for x in processor.image_std],
        "clip.use_gelu": vcfg.hidden_act == "gelu",
    } | overrides
    for key, value in keys.items():
        if value is not None:  # None: leave the key out
            _add_key(w, key, value)
    for hf_name, weight in state.items():
        name = hf_name.removeprefix("model.")  # transformers 5's layout, or the classic one
        if name.startswith("vision_tower."):
            name = "vision_model." + name.removeprefix("vision_tower.").removeprefix(
                "vision_model."
            )
        elif not name.startswith("multi_modal_projector."):
            continue  # the text model: the text GGUF's
        parts = name.split(".")
        if "post_layernorm" in name or "position_ids" in name:
            continue
        if len(parts) > 3 and parts[2] == "layers" and int(parts[3]) >= max(layers):
            continue
        target = _legacy_clip_name(name)
        if not swap_ffn:
            target = target.replace("ffn_down", "FFN_UP").replace("ffn_up", "ffn_down")
            target = target.replace("FFN_UP", "ffn_up")
        if weight.ndim == 4:
            weight = weight.astype(np.float16)
        w.add_tensor(target, weight)
    write_file(w)


def _add_key(w, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


# ---- llama.cpp's mmproj file of a Gemma 3 model -----------------------------------------------
def write_gemma3_mmproj(model_dir: Path, path: Path, **overrides) -> None:
    """The image side of a transformers Gemma3ForConditionalGeneration folder as
    convert_hf_to_gguf.py --mmproj --outtype f32 writes it (Gemma3VisionModel): arch `clip`,
    projector type gemma3, the clip.vision.* keys of MmprojModel, use_gelu, the pool's
    projector.scale_factor when it is not 4; tensor names from gguf-py's MMPROJ map
    ("_weight" -> ".weight" first), mm.soft_emb_norm stored as 1 + weight and
    mm.input_projection forced to F16. overrides replace metadata values (None: key left out)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoImageProcessor

    cfg = AutoConfig.from_pretrained(model_dir)
    vcfg, text = cfg.vision_config, cfg.get_text_config()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    side = vcfg.image_size // vcfg.patch_size
    scale = side // int(cfg.mm_tokens_per_image**0.5)
    keys = {
        "general.type": "mmproj",
        "general.file_type": 0,
        "general.name": "tiny-gemma3",
        "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": text.hidden_size,
        "clip.vision.image_size": vcfg.image_size,
        "clip.vision.patch_size": vcfg.patch_size,
        "clip.vision.embedding_length": vcfg.hidden_size,
        "clip.vision.feed_forward_length": vcfg.intermediate_size,
        "clip.vision.block_count": vcfg.num_hidden_layers,
        "clip.vision.attention.head_count": vcfg.num_attention_heads,
        "clip.vision.image_mean": [float(x) for x in processor.image_mean],
        "clip.vision.image_std": [float(x) for x in processor.image_std],
        "clip.projector_type": "gemma3",
        "clip.vision.attention.layer_norm_epsilon": float(vcfg.layer_norm_eps),
        "clip.use_gelu": True,
    }
    if scale != 4:
        keys["clip.vision.projector.scale_factor"] = scale
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vcfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "clip")
    for key, value in (keys | overrides).items():
        if value is not None:
            _add_key(w, key, value)
    for hf_name, weight in load_file(str(model_dir / "model.safetensors")).items():
        name = hf_name.removeprefix("model.")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue  # the text model: the text GGUF's
        if "position_ids" in name:
            continue
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_"):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")  # hub layout
        stem, _, kind = name.replace("_weight", ".weight").rpartition(".")
        if names.get_name(stem) is None:
            raise ValueError(f"no mmproj GGUF name for tensor {hf_name!r}")
        target = f"{names.get_name(stem)}.{kind}"
        if "soft_emb_norm" in name:
            weight = weight + 1.0
        if "input_projection" in name:
            weight = weight.astype(np.float16)
        w.add_tensor(target, weight)
    write_file(w)


# ---- llama.cpp's mmproj file of a Qwen2.5-VL model --------------------------------------------
def write_qwen2_5_vl_mmproj(
    model_dir: Path, path: Path, fused_qkv: bool = False, drop: tuple = (), **overrides
):
    """The image side of a transformers Qwen2_5_VLForConditionalGeneration folder as
    convert_hf_to_gguf.py --mmproj --outtype f32 writes it (Qwen2VLVisionModel): arch `clip`,
    projector type qwen2.5vl_merger, use_silu, n_wa_pattern = fullatt_block_indexes[0] + 1, the
    layer norm eps from the top-level rms_norm_eps (1e-6 when absent), image_size 560 when the
    config has none; qkv split into q, k, v (fused_qkv keeps attn_qkv as older files do); the
    Conv3d patch embedding split over its temporal taps into v.patch_embd.weight and
    v.patch_embd.weight.1; other names from gguf-py's MMPROJ map. overrides replace metadata
    values (None: key left out); drop names GGUF tensors to leave out."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoImageProcessor

    cfg = AutoConfig.from_pretrained(model_dir)
    vcfg, text = cfg.vision_config, cfg.get_text_config()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    full = list(vcfg.fullatt_block_indexes)
    keys = {
        "general.type": "mmproj",
        "general.file_type": 0,
        "general.name": "tiny-qwen2.5-vl",
        "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": text.hidden_size,
        "clip.vision.image_size": getattr(vcfg, "image_size", None) or 560,
        "clip.vision.patch_size": vcfg.patch_size,
        "clip.vision.embedding_length": vcfg.hidden_size,
        "clip.vision.feed_forward_length": vcfg.intermediate_size,
        "clip.vision.block_count": vcfg.depth,
        "clip.vision.attention.head_count": vcfg.num_heads,
        "clip.vision.image_mean": [float(x) for x in processor.image_mean],
        "clip.vision.image_std": [float(x) for x in processor.image_std],
        "clip.projector_type": "qwen2.5vl_merger",
        "clip.use_silu": True,
        "clip.vision.n_wa_pattern": full[0] + 1,
        "clip.vision.attention.layer_norm_epsilon": float(cfg.to_dict().get("rms_norm_eps", 1e-6)),
    }
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vcfg.depth)
    w = gguf.GGUFWriter(str(path), "clip")
    for key, value in (keys | overrides).items():
        if value is not None:
            _add_key(w, key, value)
    for hf_name, weight in load_file(str(model_dir / "model.safetensors")).items():
        name = hf_name.removeprefix("model.")
        if not name.startswith("visual."):
            continue  # the text model: the text GGUF's
        if "patch_embed.proj.weight" in name:
            for tap, target in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
                if target not in drop:
                    w.add_tensor(target, np.ascontiguousarray(weight[:, :, tap]))
            continue
        stem, _, kind = name.rpartition(".")
        if ".qkv" in stem and not fused_qkv:
            for part, chunk in zip("qkv", _split3(weight)):
                target = names.get_name(stem.replace("qkv", part))
                w.add_tensor(f"{target}.{kind}", np.ascontiguousarray(chunk))
            continue
        if names.get_name(stem) is None:
            raise ValueError(f"no mmproj GGUF name for tensor {hf_name!r}")
        w.add_tensor(f"{names.get_name(stem)}.{kind}", weight)
    write_file(w)


def _split3(weight):
    c = weight.shape[0] // 3
    return weight[:c], weight[c : 2 * c], weight[2 * c :]
