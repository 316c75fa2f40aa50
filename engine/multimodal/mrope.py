"""Per-token M-RoPE positions (Qwen2.5-VL) for one scheduled step, from each request's images.

Positions follow transformers' get_rope_index for still images: text tokens count on by one;
an image's tokens, starting at text position S, get (S + t, S + row, S + column) over its merged
grid (t, h, w); the text after it continues at S + max(h, w). So every token after an image is
shifted by max(h, w) - (its token count), and decode runs at its index plus the request's total
shift (transformers' rope delta). Computed per step from the token index alone, the positions
are the same for a chunk that starts inside an image, after a prefix-cache hit and on recompute
after preemption. A step with no image token scheduled gets positions [T] (plain RoPE at the
shifted position: the fused and graph paths run as for text); otherwise [3, T].
"""

from __future__ import annotations

import numpy as np


class MRopePositions:
    def __init__(self, spatial_merge: int) -> None:
        self.merge = spatial_merge

    @classmethod
    def build(cls, model) -> MRopePositions | None:
        """None for a model without M-RoPE."""
        if not getattr(model, "uses_mrope", False):
            return None
        return cls(model.spatial_merge)

    def positions(self, out, positions: np.ndarray) -> np.ndarray:
        """positions: the step's token indices [T]; -> [T] or [3, T] rotary positions."""
        shifted = positions.copy()
        inside: list[tuple[np.ndarray, np.ndarray]] = []  # (rows of the step, [3, n] positions)
        offset = 0
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            if req.mm_inputs:
                self._request(
                    req.mm_inputs, positions[offset : offset + n], offset, shifted, inside
                )
            offset += n
        if not inside:
            return shifted
        three = np.tile(shifted, (3, 1))
        for rows, values in inside:
            three[:, rows] = values
        return three

    def _request(self, images, p: np.ndarray, offset: int, shifted: np.ndarray, inside) -> None:
        """Shifts the text tokens after each image; collects the image tokens' positions."""
        view = shifted[offset : offset + len(p)]
        shift = 0
        for image in sorted(images, key=lambda i: i.start):
            t, h, w = image.grid_thw
            h, w = h // self.merge, w // self.merge
            start, end = image.start, image.start + image.length
            mask = (p >= start) & (p < end)
            if mask.any():
                k = p[mask] - start
                base = start + shift
                values = np.stack([base + k // (h * w), base + (k // w) % h, base + k % w])
                inside.append((offset + np.flatnonzero(mask), values))
            delta = max(h, w) - image.length
            view[p >= end] += delta
            shift += delta
