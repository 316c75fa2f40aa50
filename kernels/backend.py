"""The attention-backend seam: metadata for one flattened batch and the backend interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Describes a flattened token batch of num_seqs sequences (no padding between them).

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its context is
    seq_lens[i] tokens, of which the last query_lens[i] are new (causal mask bottom-right).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each new token's KV
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including new tokens
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int32
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Leading block-table entries that every decoding sequence (one query) holds, the same
    # physical blocks (a shared, prefix-cached prompt), each short of its newest token; 0 when
    # fewer than two sequences decode. Backends may read that prefix once for all of them.
    decode_shared_blocks: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]
