"""llama.cpp's `gemma3` mmproj (convert_hf_to_gguf.py --mmproj on a Gemma3ForConditionalGeneration)
as the image side of a Hugging Face Gemma3ForConditionalGeneration folder.

The file holds the SigLIP tower (v.patch_embd, v.position_embd, v.blk.N.*, v.post_ln: every
layer, the tower's last hidden state is what the projector reads), the projector's
mm.soft_emb_norm.weight (stored as 1 + weight, Gemma's RMSNorm factor) and
mm.input_projection.weight (transformers' [vision width, text width] parameter as it is). Keys:
clip.projector_type = gemma3, the clip.vision.* shape keys, image_mean / image_std, and
clip.vision.projector.scale_factor, the average pool's kernel over the patch grid (written only
when it is not llama.cpp's default 4: 896 / 14 = 64 patches a side pooled 4x4 to 256 tokens).

Images are resized to image_size x image_size (no crop, no pan and scan), as clip.cpp and
transformers' Gemma3ImageProcessor both do; the image sequence's tokens (<start_of_image>,
<image_soft_token>, <end_of_image>) come from the text GGUF's vocabulary.
"""

from __future__ import annotations

from typing import Any

from engine.gguf.mmproj import MmprojFile, vision_config

DEFAULT_SCALE_FACTOR = 4  # clip.cpp's proj_scale_factor for gemma3 when the key is absent
IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
SOFT_NORM = "model.multi_modal_projector.mm_soft_emb_norm.weight"


def tokens_per_image(mm: MmprojFile) -> int:
    side = int(mm.need("image_size")) // int(mm.need("patch_size"))
    scale = int(mm.vision("projector.scale_factor", DEFAULT_SCALE_FACTOR))
    if scale <= 0 or side % scale:
        raise ValueError(
            f"--mmproj {mm.path.name}: clip.vision.projector.scale_factor {scale} does not pool "
            f"the {side}x{side} patch grid evenly"
        )
    return (side // scale) ** 2


def gemma3_config(mm: MmprojFile, text_config: dict[str, Any], token_ids: list[int]) -> dict:
    """config.json of the Gemma3ForConditionalGeneration folder; token_ids are the vocabulary's
    (<start_of_image>, <image_soft_token>, <end_of_image>)."""
    if text_config.get("model_type") != "gemma3_text":
        raise ValueError(
            f"--mmproj {mm.path.name}: a gemma3 projector goes with a Gemma 3 text GGUF, not "
            f"{text_config.get('model_type')!r}"
        )
    for name in ("mm.input_projection.weight", "mm.soft_emb_norm.weight", "v.post_ln.weight"):
        if name not in mm.tensors:
            raise ValueError(f"--mmproj {mm.path.name}: gemma3 projector tensor {name} missing")
    width, hidden = mm.tensors["mm.input_projection.weight"].shape, text_config["hidden_size"]
    if width[1] != hidden or width[0] != int(mm.need("embedding_length")):
        raise ValueError(
            f"--mmproj {mm.path.name}: its projector makes {width[1]}-wide embeddings from "
            f"{width[0]}-wide patches; the text model's hidden size is {hidden} and the tower's "
            f"width {mm.need('embedding_length')}; give the mmproj made for this model"
        )
    boi, image, eoi = token_ids
    text = {k: v for k, v in text_config.items() if k != "architectures"}
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": vision_config(mm) | {"vision_use_head": False},
        "mm_tokens_per_image": tokens_per_image(mm),
        "boi_token_index": boi,
        "eoi_token_index": eoi,
        "image_token_index": image,
        "torch_dtype": text_config.get("torch_dtype", "float32"),
        "tie_word_embeddings": text_config.get("tie_word_embeddings", True),
    }


def image_processor(mm: MmprojFile):
    """transformers' Gemma 3 image processor at the file's image size, mean and std."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    size = int(mm.need("image_size"))
    return Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=[float(x) for x in mm.need("image_mean")],
        image_std=[float(x) for x in mm.need("image_std")],
        do_pan_and_scan=False,
    )


def fix_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """Undo the converter's 1 + weight of the projector's norm (transformers adds the 1)."""
    tensors[SOFT_NORM] = tensors[SOFT_NORM] - 1.0
    return tensors
