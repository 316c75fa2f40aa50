"""Image embeddings by content hash: LRU, bounded in bytes (the runner's encoder cache)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        """Keeps value unless it alone is over the bound; evicts least recently used first."""
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        while self.num_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.num_bytes += size
