"""llama.cpp's `qwen2.5vl_merger` mmproj (convert_hf_to_gguf.py --mmproj on a
Qwen2_5_VLForConditionalGeneration, its Qwen2VLVisionModel) as the image side of a Hugging Face
Qwen2_5_VLForConditionalGeneration folder, beside a `qwen2vl` text GGUF.

What the converter writes (and clip.cpp reads): the tower's q, k, v split out of the fused qkv
(v.blk.N.attn_q/attn_k/attn_v; a fused attn_qkv is read too), the Conv3d patch embedding split
over its two temporal taps into v.patch_embd.weight and v.patch_embd.weight.1, RMSNorms
v.blk.N.ln1 / ln2, the gated MLP ffn_gate / ffn_up / ffn_down, the merger's ln_q as v.post_ln
and its two linears as mm.0 / mm.2. Keys: clip.projector_type = qwen2.5vl_merger, the
clip.vision.* shape keys, clip.use_silu, clip.vision.n_wa_pattern (every n-th block attends
over the whole image: transformers' fullatt_block_indexes n-1, 2n-1, ...), the optional
clip.vision.spatial_merge_size (2) and clip.vision.window_size (clip.cpp's 112 pixels when
absent; the converter does not write it). Images are sized as clip.cpp sizes them: between 8
and 4096 merged tokens (or clip.vision.image_min_pixels / image_max_pixels), by transformers'
Qwen2VLImageProcessor at the file's patch size, mean and std.
"""

from __future__ import annotations

from typing import Any

from engine.gguf.mmproj import MmprojFile

PROJECTOR = "qwen2.5vl_merger"
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
DEFAULT_WINDOW = 112  # clip.cpp's attention window in pixels when clip.vision.window_size is absent
DEFAULT_MERGE = 2
MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp's set_limit_image_tokens for Qwen2/2.5-VL
_LAYER_NAMES = {
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "attn.qkv",
}
_GLOBAL_NAMES = {
    "v.post_ln": "visual.merger.ln_q",
    "mm.0": "visual.merger.mlp.0",
    "mm.2": "visual.merger.mlp.2",
}
PATCH, PATCH_1 = "v.patch_embd.weight", "v.patch_embd.weight.1"


def _merge(mm: MmprojFile) -> int:
    return int(mm.vision("spatial_merge_size", DEFAULT_MERGE))


def vision_config(mm: MmprojFile) -> dict[str, Any]:
    """transformers' Qwen2_5_VLVisionConfig of the stored tower."""
    depth = int(mm.need("block_count"))
    pattern = int(mm.need("n_wa_pattern"))
    if pattern <= 0:
        raise ValueError(f"--mmproj {mm.path.name}: clip.vision.n_wa_pattern {pattern} is not > 0")
    if "mm.2.weight" not in mm.tensors or "mm.0.weight" not in mm.tensors:
        raise ValueError(f"--mmproj {mm.path.name}: no merger tensors (mm.0, mm.2)")
    return {
        "depth": depth,
        "hidden_size": int(mm.need("embedding_length")),
        "intermediate_size": int(mm.need("feed_forward_length")),
        "num_heads": int(mm.need("attention.head_count")),
        "patch_size": int(mm.need("patch_size")),
        "spatial_merge_size": _merge(mm),
        "temporal_patch_size": 2,
        "window_size": int(mm.vision("window_size", DEFAULT_WINDOW)),
        "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0],
        "out_hidden_size": int(mm.tensors["mm.2.weight"].shape[0]),
        "hidden_act": "silu",
        "in_channels": 3,
    }


def qwen2_5_vl_config(mm: MmprojFile, text_config: dict[str, Any], token_ids: list[int]) -> dict:
    """config.json of the Qwen2_5_VLForConditionalGeneration folder; token_ids are the
    vocabulary's (<|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>)."""
    section = text_config.get("mrope_section")
    if not section:
        raise ValueError(
            f"--mmproj {mm.path.name}: a {PROJECTOR} projector goes with a qwen2vl text GGUF "
            f"(M-RoPE sections), not {text_config.get('model_type')!r}"
        )
    if text_config.get("rope_scaling"):
        raise ValueError(f"--mmproj {mm.path.name}: M-RoPE with rope scaling is not supported")
    vision = vision_config(mm)
    hidden = text_config["hidden_size"]
    width = vision["hidden_size"] * vision["spatial_merge_size"] ** 2
    got = mm.tensors["mm.0.weight"].shape[1], vision["out_hidden_size"]
    if got != (width, hidden):
        raise ValueError(
            f"--mmproj {mm.path.name}: its merger maps {got[0]} to {got[1]}; the tower's merged "
            f"width is {width} and the text model's hidden size {hidden}; give the mmproj made "
            "for this model"
        )
    start, image, end, video = token_ids
    text = {k: v for k, v in text_config.items() if k not in ("architectures", "mrope_section")}
    rope = {"rope_type": "default", "rope_theta": text["rope_theta"], "mrope_section": section}
    text.update(model_type="qwen2_5_vl_text", rope_parameters=rope)
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": image,
        "video_token_id": video,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "torch_dtype": text_config.get("torch_dtype", "float32"),
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
    }


def image_processor(mm: MmprojFile):
    """transformers' Qwen2-VL image processor at the file's patch size, mean and std, sizing
    images between clip.cpp's token limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    patch, merge = int(mm.need("patch_size")), _merge(mm)
    area = (patch * merge) ** 2
    return Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
        size={
            "shortest_edge": int(mm.vision("image_min_pixels", MIN_TOKENS * area)),
            "longest_edge": int(mm.vision("image_max_pixels", MAX_TOKENS * area)),
        },
        image_mean=[float(x) for x in mm.need("image_mean")],
        image_std=[float(x) for x in mm.need("image_std")],
    )


def hf_tensors(mm: MmprojFile) -> dict[str, Any]:
    """The tower and merger under Qwen2_5_VLForConditionalGeneration's classic names (visual.*):
    the two patch taps stacked back into the Conv3d, q/k/v joined into qkv."""
    import numpy as np

    tensors = dict(mm.tensors)
    if PATCH not in tensors or PATCH_1 not in tensors:
        raise ValueError(
            f"--mmproj {mm.path.name}: {PATCH} and {PATCH_1} (the Conv3d's two temporal taps) "
            "are both needed"
        )
    taps = [tensors.pop(PATCH), tensors.pop(PATCH_1)]  # [D, C, P, P] each, at t = 0 and 1
    out = {"visual.patch_embed.proj.weight": np.stack(taps, 2)}
    for layer in range(int(mm.need("block_count"))):
        for kind in ("weight", "bias"):
            parts = [tensors.pop(f"v.blk.{layer}.attn_{p}.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"visual.blocks.{layer}.attn.qkv.{kind}"] = np.concatenate(parts, 0)
    for name, array in tensors.items():
        out[_hf_name(mm, name)] = array
    return out


def _hf_name(mm: MmprojFile, name: str) -> str:
    stem, _, kind = name.rpartition(".")
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
        return f"visual.blocks.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"--mmproj {mm.path.name}: tensor {name!r} is not known for {PROJECTOR}")
