"""flash-attn over the paged KV cache: varlen for prefill/chunked prefill, kvcache for decode.

KV is written by slot_mapping first (a Triton store where Triton runs, else the torch write),
then attention reads it back through the block table:

    prefill / chunked prefill / prefix hits:
        flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, causal=True, block_table=...)
    decode (one new token per sequence):
        flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=seq_lens,
                                block_table=..., causal=True)

A sliding window of W keys (the query and the W - 1 before it) is window_size=(W - 1, 0);
soft-capping is softcap=c, both in every call. flash-attn never reads the pages left of a
window, so the block table may hold placeholder ids there.

flash-attn 2 takes paged KV only when block_size % 256 == 0. flash-attn 3 (the Hopper build,
module `flash_attn_interface`) takes any block size through `page_table`, and serves both
phases from flash_attn_with_kvcache with cu_seqlens_q for ragged queries.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve_kernels.backend import AttentionBackend, AttentionMetadata
from pagedserve_kernels.encoder_attention import cu_seqlens
from pagedserve_kernels.reference import write_kv_by_slot

FA2_BLOCK_SIZE_MULTIPLE = 256


def import_flash_attn() -> tuple[ModuleType, int] | None:
    """(module, major version): FA3's flash_attn_interface first, then flash_attn 2."""
    for name, version in (("flash_attn_interface", 3), ("flash_attn", 2)):
        try:
            return importlib.import_module(name), version
        except (ImportError, OSError):  # absent, or built against another torch/CUDA
            continue
    return None


def check_block_size(block_size: int, fa_version: int) -> None:
    if fa_version == 2 and block_size % FA2_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"the flash_attn backend (flash-attn 2) needs --block-size to be a multiple of "
            f"{FA2_BLOCK_SIZE_MULTIPLE} for its paged KV cache, got {block_size}; pass "
            f"--block-size {FA2_BLOCK_SIZE_MULTIPLE} or choose --attention-backend triton/torch"
        )


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, module: ModuleType, version: int, store_kv=None) -> None:
        self.fa = module
        self.version = version
        self._store_kv = store_kv or write_kv_by_slot  # Triton's store skips padding slots

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ):
        # flash-attn's window counts keys left of the query: W keys with itself is (W - 1, 0).
        extra = dict(window_size=(window - 1, 0) if window > 0 else (-1, -1), softcap=softcap)
        if self.version == 3:
            return self._forward_fa3(query, k_cache, v_cache, meta, scale, extra)
        if meta.is_decode_only:
            return self._decode_fa2(query, k_cache, v_cache, meta, scale, extra)
        return self._prefill_fa2(query, k_cache, v_cache, meta, scale, extra)

    def encoder_attention(self, query, key, value, seq_lens, scale=None, mask=None):
        """flash-attn's varlen over the packed segments, causal=False (no block table: K/V are
        the segments' own); a mask (BERT's padding) or float32 goes to torch SDPA."""
        if mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
            return super().encoder_attention(query, key, value, seq_lens, scale, mask)
        cu = cu_seqlens(seq_lens, query.device)
        longest = max(seq_lens)
        out = self.fa.flash_attn_varlen_func(
            query, key, value, cu, cu, longest, longest, softmax_scale=scale, causal=False
        )
        return out[0] if isinstance(out, tuple) else out  # some FA3 builds return (out, lse)

    def _decode_fa2(self, query, k_cache, v_cache, meta: AttentionMetadata, scale, extra):
        out = self.fa.flash_attn_with_kvcache(
            query.unsqueeze(1),  # [num_seqs, 1, num_heads, head_dim]
            k_cache,
            v_cache,
            cache_seqlens=meta.seq_lens,
            block_table=meta.block_table,
            softmax_scale=scale,
            causal=True,
            **extra,
        )
        return out.squeeze(1)

    def _prefill_fa2(self, query, k_cache, v_cache, meta: AttentionMetadata, scale, extra):
        # cu_seqlens_k: [num_seqs + 1] int32 offsets of each sequence's whole context
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self.fa.flash_attn_varlen_func(
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            cu_seqlens_k,
            meta.max_query_len,
            meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_table,
            **extra,
        )

    def _forward_fa3(self, query, k_cache, v_cache, meta: AttentionMetadata, scale, extra):
        if meta.is_decode_only:
            q = query.unsqueeze(1)
        else:  # ragged queries: q stays flat [num_tokens, num_heads, head_dim]
            q = query
            extra = dict(extra, cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len)
        out = self.fa.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=meta.seq_lens,
            page_table=meta.block_table,
            softmax_scale=scale,
            causal=True,
            **extra,
        )
        return out.squeeze(1) if meta.is_decode_only else out
