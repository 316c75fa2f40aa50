"""The runner's image hook: the step's input embeddings with image embeddings merged in.

Each image is encoded once (all of it, whichever chunk first touches its placeholders), kept
in the EncoderCache by content hash, and sliced for the placeholder tokens a step schedules,
so chunked prefill, prefix-cache hits that end mid-image and recompute after preemption all
read the same rows. Steps without image tokens return None (the text path runs unchanged).
"""

from __future__ import annotations

import torch

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput


class MultiModalEmbedder:
    def __init__(self, model, cache_bytes: int, device: torch.device) -> None:
        self.model, self.device = model, device
        self.cache = EncoderCache(cache_bytes)
        self.num_images_encoded = 0
        self.set_step_images = getattr(model, "set_step_images", None)

    @classmethod
    def build(cls, model, cache_bytes: int, device: torch.device) -> MultiModalEmbedder | None:
        """None for a text-only model."""
        if not getattr(model, "supports_images", False):
            return None
        return cls(model, cache_bytes, device)

    def take_stats(self) -> dict[str, int]:
        """StepStats' image fields since the last call."""
        now = (self.cache.hits + self.cache.misses, self.cache.hits, self.num_images_encoded)
        last, self._last_stats = getattr(self, "_last_stats", (0, 0, 0)), now
        names = ("mm_cache_queries", "mm_cache_hits", "mm_images_encoded")
        return {name: a - b for name, a, b in zip(names, now, last)}

    def inputs_embeds(self, out, input_ids: torch.Tensor) -> torch.Tensor | None:
        """[T, hidden] for the flattened batch, or None when no image token is scheduled."""
        pieces: list[tuple[int, ImageInput, int, int]] = []  # batch row, image, [a, b) of it
        spans: list[tuple[int, int, int, int]] = []  # row, rows, sequence, image end
        offset = 0
        for seq, (req, n, start) in enumerate(
            zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ):
            for image in req.mm_inputs:
                a, b = max(start, image.start), min(start + n, image.start + image.length)
                if a < b:
                    pieces.append((offset + a - start, image, a - image.start, b - image.start))
                    spans.append((offset + a - start, b - a, seq, b))
            offset += n
        if self.set_step_images is not None:  # bidirectional image attention (Gemma 3)
            self.set_step_images(whole_image_spans(pieces, spans))
        if not pieces:
            return None
        embeddings = self._embeddings([image for _, image, _, _ in pieces])
        embeds = self.model.embed_input_ids(input_ids)
        for row, image, a, b in pieces:
            embeds[row : row + b - a] = embeddings[image.content_hash][a:b].to(embeds.dtype)
        return embeds

    def _embeddings(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Every image's [length, hidden] embedding: from the cache, else encoded (the misses
        of one shape in one batch) and cached."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            key = image.content_hash
            if key in found or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is None:
                missing[key] = image
            else:
                found[key] = cached
        encode = getattr(self.model, "encode_images", None)  # dynamic resolution: all at once
        if encode is not None and missing:
            group = list(missing.values())
            pixels = [image.pixel_values.to(self.device) for image in group]
            self._keep(group, encode(pixels, [image.grid_thw for image in group]), found)
            missing = {}
        by_shape: dict[tuple, list[ImageInput]] = {}
        for image in missing.values():
            by_shape.setdefault(tuple(image.pixel_values.shape), []).append(image)
        for group in by_shape.values():
            pixels = torch.stack([image.pixel_values for image in group]).to(self.device)
            self._keep(group, self.model.embed_images(pixels), found)
        return found

    def _keep(self, group: list[ImageInput], embeddings, found: dict) -> None:
        for image, emb in zip(group, embeddings):
            if emb.shape[0] != image.length:
                raise ValueError(f"image encoded to {emb.shape[0]} rows for {image.length}")
            found[image.content_hash] = emb
            self.cache.put(image.content_hash, emb)
        self.num_images_encoded += len(group)


def whole_image_spans(pieces, spans: list) -> list[tuple[int, int, int, int]]:
    """The spans, each checked to reach its image's end (the scheduler keeps images whole)."""
    for (_, image, _, b), span in zip(pieces, spans):
        if b != image.length:
            raise RuntimeError(f"image tokens at {span[3] - span[1]} split across prefill chunks")
    return spans
