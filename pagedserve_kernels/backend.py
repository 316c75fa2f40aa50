"""The attention-backend seam: metadata for one flattened batch and the backend interface."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve_kernels.encoder_attention import sdpa_segments


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


class AttentionBackend:
    """What every attention backend implements, and the optional capabilities it declares.

    A capability is a class attribute with a default here; a backend that has one overrides the
    attribute (and the method it names), so callers read the flag instead of probing.
    """

    name: str = "base"
    # Capture-safe under CUDA graphs: no host syncs, grids fixed by the batch size, KV writes
    # that skip slot -1 (engine/runner/cuda_graphs.py).
    supports_cuda_graphs: bool = False
    # cascade_plan() may return a plan: decodes over a shared prefix read it once for all.
    supports_cascade: bool = False
    # fused_decode() may return a step that runs every decoder layer of a decode batch at once.
    supports_fused_decode: bool = False
    # forward() takes window > 0 (sliding-window layers) / softcap > 0 (logit soft-capping).
    supports_sliding_window: bool = False
    supports_softcap: bool = False

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """window W > 0 (Hugging Face's sliding_window): the query at absolute position i sees
        keys i - W < j <= i, W keys with itself; 0 is full causal attention. Blocks wholly
        before the first key any query of a sequence sees may hold any block id (freed) and are
        never read. softcap c > 0: scores = c * tanh(q.k * scale / c) before mask and softmax
        (Gemma 2's attn_logit_softcapping). Every backend here declares both
        (supports_sliding_window, supports_softcap)."""
        raise NotImplementedError

    def encoder_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], segments back to back
        key: torch.Tensor,
        value: torch.Tensor,
        seq_lens: list[int],  # each segment's length; they sum to num_tokens
        scale: float | None = None,  # None: head_dim ** -0.5
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Non-causal attention within each segment, no KV cache (vision towers, BERT). mask:
        an SDPA attn_mask (bool, True = attend, or additive) broadcastable to [num_segments,
        num_heads, L, L], for segments all of one length L (a padded batch). The default is
        torch SDPA, one batched call per run of equal lengths (encoder_attention.py); backends
        with a faster varlen kernel override it and fall back here for what it does not cover."""
        return sdpa_segments(query, key, value, seq_lens, scale, mask)

    def cascade_plan(
        self, num_heads, dtype, k_cache, block_table, seq_lens, shared_blocks: int,
        window: int = 0, softcap: float = 0.0,
    ):
        """(prefix block ids, prefix length, suffix block table, suffix lengths), or None: run
        the batch without a cascade. Only backends with supports_cascade return a plan; they
        may decline a windowed or soft-capped layer."""
        return None

    def fused_decode(self, stack: DecoderStack) -> FusedDecodeStep | None:
        """A step running every layer of `stack` for a decode batch, or None where this backend
        has no such step or its kernels do not cover the stack (supports_fused_decode)."""
        return None


@dataclass
class QuantPart:
    """Consecutive output rows of a linear in one GGUF type, in
    pagedserve_kernels/csrc/gguf_quant.cpp's re-packed layout (engine/layers/quantization/gguf.py
    PackedQuant's buffers)."""

    qs: torch.Tensor  # uint8 [G, B, 4 or 8, 64]
    qh: torch.Tensor | None  # uint8 [G, B, 1 or 2, 64]: 5 and 6 bits only
    scales: torch.Tensor  # float32 [G, S, 16]
    mins: torch.Tensor | None  # float32 [G, B, 16]: the types with a min
    out_features: int
    bits: int
    zero: int


@dataclass
class QuantLinear:
    """A projection held as GGUF-packed parts, multiplied part by part into its output columns."""

    parts: list[QuantPart]


@dataclass
class DecoderStack:
    """A pre-norm decoder (Llama's layer shape: norm, qkv, rope, attention, o, norm, gate_up,
    SiLU-and-mul, down) in the terms a fused decode kernel takes.

    layer_weights holds per layer: input norm weight, qkv, (qkv bias), (q norm, k norm weights),
    o, post-attention norm weight, gate_up, down: six tensors, seven with qkv_bias, eight with
    qk_norm, nine with both. A projection is a tensor as the kernels packed it (the AMX packing
    in bf16), a QuantLinear (GGUF-packed parts), or None where the layer holds neither.
    """

    layer_weights: list[torch.Tensor | QuantLinear | None]
    final_norm_weight: torch.Tensor
    eps: float  # every norm's, the same
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    # Any layer's sliding window / logit cap (0: none); fused decode kernels decline either.
    window: int = 0
    softcap: float = 0.0
    qkv_bias: bool = False  # every layer's qkv has a bias (Qwen2)
    qk_norm: bool = False  # every layer has per-head q/k norms (Qwen3)

    @property
    def has_quant(self) -> bool:
        return any(isinstance(w, QuantLinear) for w in self.layer_weights)


class FusedDecodeStep:
    """Runs a decode batch through a whole DecoderStack; built by AttentionBackend.fused_decode."""

    def can_run(self, meta: AttentionMetadata) -> bool:
        raise NotImplementedError

    def __call__(
        self,
        x: torch.Tensor,  # [num_seqs, hidden] embeddings of the new tokens
        positions: torch.Tensor,  # [num_seqs]
        cos_sin: torch.Tensor,  # [>= max_seq_len, head_dim] cos | sin per position
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [num_seqs, hidden], final norm applied
        raise NotImplementedError
