"""The scheduler's per-step encoder budget (vLLM's max_num_encoder_input_tokens idea).

An image is encoded, whole, in the step whose chunk first reaches its placeholder tokens. Each
step may start encoding images worth at most `max_tokens` placeholder tokens: a chunk that
would reach an image the budget cannot pay for stops just before the image's first placeholder
(the tokens before it still run), and the image waits for a later step. So a prompt of many
images, or many image requests arriving together, spreads its encoder work over steps instead
of stalling one step; an image never starts in a chunk whose embedding is not computed in that
same step. An image larger than the whole budget runs alone in a step (never starved).
An image the model attends to bidirectionally (ImageInput.whole: Gemma 3) is never split: a
chunk that would end inside it stops before it (or, started inside it after a prefix-cache hit,
waits for a step whose token budget reaches its end).

The scheduler's view of what is encoded is the content hashes it has let through (bounded, least
recently used first out); if the runner's cache dropped one, the runner re-encodes it off-budget.
"""

from __future__ import annotations

from collections import OrderedDict

_MAX_REMEMBERED = 4096


class EncoderBudget:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.left = max_tokens
        self._encoded: OrderedDict[bytes, None] = OrderedDict()

    def new_step(self) -> None:
        self.left = self.max_tokens

    def clip(self, req, computed: int, num_new: int, commit: bool = True) -> int:
        """How many of req's num_new tokens from `computed` on may run this step; charges the
        images they start (commit=False: only says, for a caller that may not schedule them)."""
        images = req.mm_inputs
        if not images:
            return num_new
        end, left = computed + num_new, self.left
        for image in images:
            if image.start + image.length <= computed or image.start >= end:
                continue
            if image.whole and image.start + image.length > end:  # never split (Gemma 3)
                return max(0, image.start - computed)
            key = image.content_hash
            if key in self._encoded:
                self._encoded.move_to_end(key)
                continue
            if image.length > left and left < self.max_tokens:
                return max(0, image.start - computed)  # wait for a step with budget left
            left = max(0, left - image.length)
            if commit:
                self.left = left
                self._encoded[key] = None
                if len(self._encoded) > _MAX_REMEMBERED:
                    self._encoded.popitem(last=False)
        return num_new
