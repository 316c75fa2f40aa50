"""Image content parts (chat `image_url`, Responses `input_image`) -> pixels for the engine.

Each part is fetched under the operator's rules (engine/multimodal/media.py), decoded with
Pillow and preprocessed by the model's image processor, all in a worker thread; the chat
template sees the model's image token where each part was. Every refusal is a 400 naming the
part (messages[i].content[j]).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.multimodal.media import fetch_image_bytes
from engine.multimodal.processor import ImageError, decode_image
from server.openai.errors import APIError

IMAGE_PART_TYPES = ("image_url", "input_image")
_DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # the request field that holds it


@dataclass(frozen=True)
class ImagePart:
    part: object  # protocol.TextPart of an image type
    param: str  # messages[i].content[j]


def image_ref(part, param: str) -> ImageRef:
    """The URL of an image part: chat's {"image_url": {"url", "detail"}} or Responses'
    {"image_url": "..."}; `detail` is accepted (the model's processor fixes the resolution)."""
    value = getattr(part, "image_url", None)
    detail = None
    if isinstance(value, dict):
        value, detail = value.get("url"), value.get("detail")
    detail = detail or getattr(part, "detail", None)
    if detail is not None and detail not in _DETAILS:
        raise APIError(400, f"detail must be one of {', '.join(_DETAILS)}", param=f"{param}.detail")
    if not isinstance(value, str) or not value:
        if getattr(part, "file_id", None):
            raise APIError(400, "file_id images are not supported; send image_url", param=param)
        raise APIError(400, "an image part needs image_url with a url", param=f"{param}.image_url")
    return ImageRef(value, f"{param}.image_url")


def collect_image_refs(messages) -> list[ImagePart]:
    """Every image part of the conversation, in the order the template will place them."""
    parts = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type in IMAGE_PART_TYPES:
                    parts.append(ImagePart(part, f"messages[{i}].content[{j}]"))
    return parts


async def load_images(ctx, parts: list[ImagePart]) -> list:
    """[3, H, W] pixels per image (off the event loop), or a 400 naming the part."""
    mm = getattr(ctx.engine, "mm_processor", None)
    if mm is None:
        msg = f"model {ctx.model_name!r} does not take images (text only); remove the image parts"
        param = f"{parts[0].param}.image_url"
        raise APIError(400, msg, param=param, code="model_not_multimodal")
    refs = [image_ref(p.part, p.param) for p in parts]
    if len(refs) > mm.max_images:
        msg = f"{len(refs)} images in one request; this server takes at most {mm.max_images}"
        raise APIError(400, msg, param=refs[mm.max_images].param, code="too_many_images")
    config = ctx.engine.media_config

    def work() -> list:
        return [mm.pixels(decode_image(fetch_image_bytes(r.url, config, r.param), r.param), r.param)
                for r in refs]  # fmt: skip

    try:
        return await asyncio.to_thread(work)
    except ImageError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def expand_prompt(ctx, prompt_ids: list[int], pixels: list) -> tuple[list[int], list]:
    """(prompt ids with each image token expanded, the engine's ImageInputs)."""
    try:
        return ctx.engine.mm_processor.expand(prompt_ids, pixels)
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code=getattr(e, "code", None)) from None
