"""A llama.cpp `mmproj` GGUF (the vision tower and projector of a vision-language model, shipped
beside the text GGUF: `llama-server -m model.gguf --mmproj mmproj.gguf`) as the image side of a
Hugging Face LLaVA folder: the vision config, the image processor's settings and the tensors
under transformers' LlavaForConditionalGeneration names.

The file is llama.cpp's `clip` architecture (tools/mtmd/clip-impl.h): `clip.projector_type`
(or `clip.vision.projector_type`) names the projector, `clip.vision.*` the tower's shape
(embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, image_size, patch_size, image_mean, image_std, feature_layer),
`clip.use_gelu` / `clip.use_silu` the tower's activation. Tensors: v.patch_embd, v.class_embd,
v.position_embd, v.pre_ln, v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,ffn_down},
and the LLaVA projector mm.0 (linear_1) and mm.2 (linear_2). Files from llama.cpp's legacy
converter store the tower's fc1 as ffn_down and fc2 as ffn_up; as clip.cpp does, a pair whose
shapes say so is swapped back. The tower holds only the layers the projector reads (the
converter drops the rest), so the feature layer is counted in the stored tower.

Projector types served: `mlp` (LLaVA 1.5 style: CLIP or SigLIP tower, two linears with GELU)
and `gemma3` (Gemma 3: the SigLIP tower with v.post_ln, mm.soft_emb_norm stored as 1 + weight,
mm.input_projection stored [vision width, text width]; engine/gguf/mmproj_gemma3.py) and
`qwen2.5vl_merger` (Qwen2.5-VL: engine/gguf/mmproj_qwen2_5_vl.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.gguf.families import Meta

SUPPORTED_PROJECTORS = ("mlp", "gemma3", "qwen2.5vl_merger")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_GLOBAL_NAMES = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.pre_ln": "pre_layrnorm",
    "v.post_ln": "post_layernorm",
}
_PROJECTOR_NAMES = {
    "mm.0": "linear_1",
    "mm.2": "linear_2",
    "mm.soft_emb_norm": "mm_soft_emb_norm",  # gemma3
}
# gemma3: the projection is a bare parameter in transformers, not a Linear
_BARE_PARAMETERS = {"mm.input_projection.weight": "mm_input_projection_weight"}
_UNUSED = ("v.head.",)  # SigLIP's pooling head, which LLaVA never reads (clip.cpp neither)
TOWER_PREFIX = "model.vision_tower.vision_model."
PROJECTOR_PREFIX = "model.multi_modal_projector."


class MmprojFile:
    """One mmproj GGUF read: meta (its metadata), tensors (GGUF name -> float32 array)."""

    def __init__(self, path: Path) -> None:
        import gguf

        from engine.gguf.convert import read_metadata

        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"--mmproj {self.path.name}: not a readable GGUF file ({e})") from None
        self.meta: Meta = read_metadata(reader)
        if self.meta.architecture != "clip":
            raise ValueError(
                f"--mmproj {self.path.name}: GGUF architecture {self.meta.architecture!r}, not "
                "llama.cpp's 'clip' (an mmproj file holds a vision tower and projector; give the "
                "text model with --model)"
            )
        if self.meta.get("clip.has_vision_encoder") is False:
            raise ValueError(f"--mmproj {self.path.name}: the file has no vision encoder")
        self.projector_type = str(
            self.meta.get("clip.vision.projector_type") or self.meta.get("clip.projector_type")
        )
        if self.projector_type not in SUPPORTED_PROJECTORS:
            raise ValueError(
                f"--mmproj {self.path.name}: projector type {self.projector_type!r} is not "
                f"supported (supported: {', '.join(SUPPORTED_PROJECTORS)})"
            )
        if self.vision("image_grid_pinpoints") is not None or self.vision(
            "mm_patch_merge_type", "flat"
        ) not in ("flat", None):
            raise ValueError(
                f"--mmproj {self.path.name}: LLaVA-NeXT's tiled images (image_grid_pinpoints, "
                "spatial_unpad) are not supported; LLaVA 1.5 style single-tile files are"
            )
        self.tensors = _read_tensors(self.path, reader)

    def vision(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"clip.vision.{key}", default)

    def need(self, key: str) -> Any:
        """clip.vision.<key>, or a ValueError naming the missing key."""
        value = self.vision(key)
        if value is None:
            raise ValueError(f"--mmproj {self.path.name}: metadata key clip.vision.{key} missing")
        return value


def _read_tensors(path: Path, reader: Any) -> dict[str, Any]:
    from gguf.quants import dequantize

    out = {}
    for tensor in reader.tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            msg = f"--mmproj {path.name}: tensor {tensor.name} has quant type "
            raise ValueError(f"{msg}{tensor.tensor_type.name}, which gguf-py cannot read") from None
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF dims are fastest-first
        out[tensor.name] = array.astype("float32", copy=False).reshape(shape)
    return out


def vision_config(mm: MmprojFile) -> dict[str, Any]:
    """transformers' CLIPVisionConfig / SiglipVisionConfig of the stored tower."""
    siglip = "v.class_embd" not in mm.tensors  # CLIP has the class token, SigLIP none
    if mm.projector_type == "gemma3":
        act = "gelu_pytorch_tanh"  # Gemma 3's SigLIP (the converter's use_gelu is always true)
    elif mm.meta.get("clip.use_gelu"):
        act = "gelu"  # the converter's use_gelu is hidden_act == "gelu"
    elif mm.meta.get("clip.use_silu"):
        act = "silu"
    else:
        act = "gelu_pytorch_tanh" if siglip else "quick_gelu"
    return {
        "model_type": "siglip_vision_model" if siglip else "clip_vision_model",
        "hidden_size": int(mm.need("embedding_length")),
        "intermediate_size": int(mm.need("feed_forward_length")),
        "num_hidden_layers": int(mm.need("block_count")),
        "num_attention_heads": int(mm.need("attention.head_count")),
        "layer_norm_eps": float(mm.vision("attention.layer_norm_epsilon", 1e-5)),
        "image_size": int(mm.need("image_size")),
        "patch_size": int(mm.need("patch_size")),
        "num_channels": 3,
        "hidden_act": act,
    }


def llava_config(mm: MmprojFile, text_config: dict[str, Any], image_token_id: int) -> dict:
    """config.json of the LLaVA folder: text_config from the text GGUF, the tower from mm."""
    vcfg = vision_config(mm)
    hidden = text_config["hidden_size"]
    if "mm.0.weight" not in mm.tensors or "mm.2.weight" not in mm.tensors:
        raise ValueError(f"--mmproj {mm.path.name}: no LLaVA projector tensors (mm.0, mm.2)")
    out_dim = mm.tensors["mm.2.weight"].shape[0]
    if out_dim != hidden:
        raise ValueError(
            f"--mmproj {mm.path.name}: its projector makes {out_dim}-wide embeddings and the "
            f"text model's hidden size is {hidden}; give the mmproj made for this model"
        )
    layers = vcfg["num_hidden_layers"]
    # the converter stores hidden-state indexes (0: embeddings, k: after block k) and keeps
    # blocks up to the deepest; without them it drops the last block and uses the rest
    feature = [int(i) for i in mm.vision("feature_layer", None) or [layers]]
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text_config,
        "vision_config": vcfg,
        "image_token_id": image_token_id,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": "mm.0.bias" in mm.tensors,
        "vision_feature_layer": feature[0] if len(feature) == 1 else feature,
        "vision_feature_select_strategy": (
            "full" if vcfg["model_type"] == "siglip_vision_model" else "default"
        ),
        "torch_dtype": text_config.get("torch_dtype", "float32"),
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
    }


def image_processor(mm: MmprojFile):
    """transformers' CLIPImageProcessor at the file's image size, mean and std (resize the
    shortest edge, centre crop, rescale, normalise: LLaVA 1.5's own preprocessing)."""
    from transformers import CLIPImageProcessor

    size = int(mm.need("image_size"))
    return CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_mean=[float(x) for x in mm.need("image_mean")],
        image_std=[float(x) for x in mm.need("image_std")],
    )


def hf_tensors(mm: MmprojFile) -> dict[str, Any]:
    """The tower and projector under LlavaForConditionalGeneration's names."""
    out: dict[str, Any] = {}
    hidden = int(mm.need("embedding_length"))
    for name, array in mm.tensors.items():
        if not name.startswith(_UNUSED):
            out[_hf_name(mm, name)] = array
    for layer in range(int(mm.need("block_count"))):
        up = f"{TOWER_PREFIX}encoder.layers.{layer}.mlp.fc1"
        down = f"{TOWER_PREFIX}encoder.layers.{layer}.mlp.fc2"
        if f"{down}.weight" in out and out[f"{down}.weight"].shape[1] == hidden:
            for kind in ("weight", "bias"):  # legacy naming: fc1 stored as ffn_down
                a, b = out.pop(f"{up}.{kind}", None), out.pop(f"{down}.{kind}", None)
                if b is not None:
                    out[f"{up}.{kind}"] = b
                if a is not None:
                    out[f"{down}.{kind}"] = a
    return out


def _hf_name(mm: MmprojFile, name: str) -> str:
    stem, _, kind = name.rpartition(".")
    parts = name.split(".")
    if name in _BARE_PARAMETERS:
        return f"{PROJECTOR_PREFIX}{_BARE_PARAMETERS[name]}"
    if name == "v.class_embd":
        return f"{TOWER_PREFIX}embeddings.class_embedding"
    if stem in _GLOBAL_NAMES:
        return f"{TOWER_PREFIX}{_GLOBAL_NAMES[stem]}.{kind}"
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
        return f"{TOWER_PREFIX}encoder.layers.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"
    if stem in _PROJECTOR_NAMES:
        return f"{PROJECTOR_PREFIX}{_PROJECTOR_NAMES[stem]}.{kind}"
    msg = f"--mmproj {mm.path.name}: tensor {name!r} is not known for projector type"
    raise ValueError(f"{msg} {mm.projector_type!r}")
