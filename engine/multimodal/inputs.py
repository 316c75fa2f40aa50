"""One image of a request as the engine carries it (no torch import: the scheduler's side)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageInput:
    """An image's placeholder tokens [start, start + length) in the prompt, the content hash
    that keys its embedding (encoder cache) and its KV blocks (prefix cache), and its pixels
    (the model's image processor's output, one image: [3, H, W], or Qwen2.5-VL's patches
    [t*h*w, C*T*P*P] with grid_thw (t, h, w) in patches). whole: the model attends among an
    image's tokens bidirectionally (Gemma 3), so the scheduler never splits them over chunks."""

    start: int
    length: int
    content_hash: bytes
    pixel_values: object  # torch.Tensor
    grid_thw: tuple[int, int, int] | None = None
    whole: bool = False

    @property
    def span(self) -> tuple[int, int, bytes]:
        """Request.mm_spans' entry."""
        return (self.start, self.length, self.content_hash)
