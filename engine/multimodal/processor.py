"""Images -> pixels with the model's own transformers image processor, then the prompt's image
placeholders expanded to one token per image embedding row (ImageInput per image).

The chat template sees one `image_token` per image part (in the text, in part order); after
tokenizing, expand() turns each into num_image_tokens copies and records the span, so the
scheduler, the prefix cache (Request.mm_spans) and the runner agree on where each image is.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from engine.core.request import RequestRejectedError
from engine.multimodal.inputs import ImageInput


class ImageError(ValueError):
    """A refused image: `param` names the part, as RequestRejectedError does."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def decode_image(data: bytes, param: str):
    """Pillow image (RGB) from encoded bytes; ImageError naming `param` when it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{param} is not a readable image ({type(e).__name__})", param) from None
    return image.convert("RGB")


class ImageInputProcessor:
    """The model's image processor, its placeholder token and tokens per image."""

    def __init__(self, model_dir: Path, hf_config, tokenizer, model_cls, max_images: int) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.hf_config, self.model_cls = hf_config, model_cls
        self.image_token_id = model_cls.image_token_id_of(hf_config)
        # what the chat template sees per image part: the token itself, or a model's wrapping
        # (Qwen2.5-VL: <|vision_start|><|image_pad|><|vision_end|>)
        placeholder = getattr(model_cls, "image_placeholder_text", None)
        self.image_token = (
            placeholder(hf_config, tokenizer)
            if placeholder is not None
            else tokenizer.convert_ids_to_tokens(self.image_token_id)
        )
        self.max_images = max_images

    @classmethod
    def build(cls, model_dir, hf_config, tokenizer, max_images: int, max_num_batched_tokens=None):
        """None for a text-only model. ValueError when a step's token budget cannot hold an
        image the model prefills whole (check_chunk_budget)."""
        from engine.models import get_model_class

        model_cls = get_model_class(hf_config)
        if not getattr(model_cls, "supports_images", False):
            return None
        processor = cls(Path(model_dir), hf_config, tokenizer, model_cls, max_images)
        if max_num_batched_tokens is not None:
            processor.check_chunk_budget(max_num_batched_tokens)
        return processor

    def check_chunk_budget(self, max_num_batched_tokens: int) -> None:
        """ValueError when a step's token budget cannot hold an image the model needs whole."""
        min_chunk = getattr(self.model_cls, "min_chunk_tokens", None)
        need = min_chunk(self.hf_config) if min_chunk is not None else 0
        if max_num_batched_tokens < need:
            raise ValueError(
                f"max_num_batched_tokens {max_num_batched_tokens} is below the {need} tokens of "
                f"one image, which this model prefills in one step; set --max-num-batched-tokens "
                f">= {need}"
            )

    def pixels(self, image, param: str):
        """[3, H, W] float pixels of one Pillow image, as the model's processor makes them (or
        the model's own form of that output: Qwen2.5-VL's (patches, grid))."""
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the processor rejects odd images its own way
            raise ImageError(f"{param}: the image processor refused it ({e})", param) from None
        pixels_of = getattr(self.model_cls, "pixels_of", None)
        try:
            return out["pixel_values"][0] if pixels_of is None else pixels_of(out)
        except ValueError as e:  # the model refuses what it cannot take (e.g. Gemma 3's crops)
            raise ImageError(f"{param}: {e}", param) from None

    def expand(self, prompt_ids: list[int], pixels: list, param: str = "messages"):
        """(prompt ids with each placeholder repeated, one ImageInput per image)."""
        if len(pixels) > self.max_images:
            msg = f"{len(pixels)} images in one prompt; this server takes at most {self.max_images}"
            raise RequestRejectedError(msg, param, "too_many_images")
        token = self.image_token_id
        where = [i for i, t in enumerate(prompt_ids) if t == token]
        if len(where) != len(pixels):
            msg = (
                f"the prompt holds {len(where)} image placeholders ({self.image_token!r}) for "
                f"{len(pixels)} images; do not write {self.image_token!r} in text"
            )
            raise RequestRejectedError(msg, param)
        ids: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, pv in zip(where, pixels):
            ids += prompt_ids[prev:pos]
            pv, grid = pv if isinstance(pv, tuple) else (pv, None)
            n = self.model_cls.num_image_tokens(self.hf_config, tuple(pv.shape), grid)
            whole = getattr(self.model_cls, "prefill_images_whole", False)
            inputs.append(ImageInput(len(ids), n, content_hash(pv, grid), pv, grid, whole))
            ids += [token] * n
            prev = pos + 1
        return ids + prompt_ids[prev:], inputs


def content_hash(pixel_values, grid_thw=None) -> bytes:
    """sha256 of the preprocessed pixels, their shape and grid: what the embedding depends on."""
    meta = (tuple(pixel_values.shape), str(pixel_values.dtype), grid_thw)
    h = hashlib.sha256(repr(meta).encode())
    h.update(pixel_values.contiguous().numpy().tobytes())
    return h.digest()
