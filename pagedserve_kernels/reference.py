"""Pure-torch paged attention: the oracle every other backend is tested against.

No kernels here: the CPU C++ kernels live behind pagedserve_kernels/cpu_backend.py, which builds on
this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve_kernels.backend import AttentionBackend, AttentionMetadata


def write_kv_by_slot(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, first_block: int = 0
) -> torch.Tensor:  # [seq_len - first_block * block_size, num_kv_heads, head_dim]
    """Key positions first_block * block_size .. seq_len - 1; earlier blocks are never read."""
    block_size = cache.shape[1]
    num_blocks = -(seq_len // -block_size)
    blocks = block_ids[first_block:num_blocks].long()
    return cache[blocks].flatten(0, 1)[: seq_len - first_block * block_size]


def first_visible_block(min_q_pos: int, window: int, block_size: int) -> int:
    """The first block holding a key that a query at min_q_pos or later can see under a window
    of `window` keys (0 = no window): the blocks before it may hold anything (they are freed)."""
    if window <= 0:
        return 0
    return max(0, min_q_pos - window + 1) // block_size


def bottom_right_causal_mask(
    q_len: int, kv_len: int, device: torch.device, window: int = 0, k_start: int = 0
) -> torch.Tensor:  # [q_len, kv_len - k_start] bool, True = attend
    """Query i sits at absolute position kv_len - q_len + i and sees keys 0..that position, or
    with a window W the last W of them (i - W < j <= i); keys start at position k_start."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(k_start, kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask


def attention(q, k, v, mask, scale: float, softcap: float = 0.0, is_causal: bool = False):
    """SDPA over q [..., H, Lq, D] and k/v [..., Hkv, Lk, D]; with softcap > 0 the same in
    explicit float32 steps, scores = softcap * tanh(q.k * scale / softcap) before the mask."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
        )
    group = q.shape[-3] // k.shape[-3]
    k = k.float().repeat_interleave(group, dim=-3)  # query head h reads KV head h // group
    v = v.float().repeat_interleave(group, dim=-3)
    scores = q.float() @ k.transpose(-1, -2) * scale  # [..., H, Lq, Lk]
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One sequence at a time: the oracle every other path is tested against.

    window W > 0: the query at position i sees keys i - W < j <= i; softcap c > 0: scores are
    c * tanh(q.k * scale / c) before the mask (AttentionBackend.forward)."""
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        attend_one(query, k_cache, v_cache, meta, i, starts[i], scale, out, window, softcap)
    return out


def attend_one(
    query, k_cache, v_cache, meta: AttentionMetadata, i: int, start: int, scale, out,
    window: int = 0, softcap: float = 0.0,
):
    """Sequence i's rows of `out`: its new queries over its gathered context (from the first
    block its window reaches). Under a window, a long run of queries goes `window` at a time,
    each over its own keys only, so the work grows with q_len * window, not q_len * kv_len."""
    q_len, kv_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
    blocks = meta.block_table[i]
    if window <= 0 or q_len <= 2 * window:
        attend_rows(query, k_cache, v_cache, blocks, start, q_len, kv_len, scale, out, window,
                    softcap)
        return
    for q0 in range(0, q_len, window):
        n = min(window, q_len - q0)
        end = kv_len - q_len + q0 + n  # the context of this run ends at its last query
        attend_rows(query, k_cache, v_cache, blocks, start + q0, n, end, scale, out, window,
                    softcap)


def attend_rows(
    query, k_cache, v_cache, block_ids, start: int, q_len: int, kv_len: int, scale, out,
    window: int = 0, softcap: float = 0.0,
):
    """Rows start..start + q_len of `out`: queries at the last q_len positions of a kv_len-token
    context held in the blocks `block_ids`."""
    first = first_visible_block(kv_len - q_len, window, k_cache.shape[1])
    q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
    k = gather_kv(k_cache, block_ids, kv_len, first).transpose(0, 1)  # [Hkv, L, D]
    v = gather_kv(v_cache, block_ids, kv_len, first).transpose(0, 1)
    # A whole prompt (q_len == kv_len) is plain causal: no mask tensor, blocks above skipped.
    fresh = q_len == kv_len and q_len > 1 and window <= 0
    mask = None
    if not fresh and (q_len > 1 or window > 0):
        k_start = first * k_cache.shape[1]
        mask = bottom_right_causal_mask(q_len, kv_len, q.device, window, k_start)
    o = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale, softcap, fresh)
    out[start : start + q_len] = o[0].transpose(0, 1)


@dataclass
class MixedPlan:
    """How paged_attention_mixed splits one step's batch: the same in every layer, so built once
    per step (TorchAttentionBackend.forward keeps the step's) instead of once per layer."""

    starts: list[int]  # each sequence's first query row
    prefill_seqs: list[int]  # the sequences with more than one query
    groups: dict[tuple[int, int], list[int]]  # those by (query length, context length)
    decode_seqs: list[int]  # one query each
    decode_rows: slice | torch.Tensor | None = None  # their rows (a slice where consecutive)
    decode_args: tuple = ()  # block_table, seq_lens, max_seq_len of those sequences


def mixed_plan(meta: AttentionMetadata, device) -> MixedPlan:
    starts = meta.query_start_loc.tolist()
    plan = MixedPlan(starts, [], {}, [])
    for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 1:
            plan.decode_seqs.append(i)
        else:
            plan.prefill_seqs.append(i)
            plan.groups.setdefault((q_len, kv_len), []).append(i)
    seqs = plan.decode_seqs
    if len(seqs) > 1:
        if seqs[-1] - seqs[0] == len(seqs) - 1:  # consecutive sequences: consecutive rows
            seq_idx = slice(seqs[0], seqs[-1] + 1)
            plan.decode_rows = slice(starts[seqs[0]], starts[seqs[-1]] + 1)
        else:
            seq_idx = torch.tensor(seqs, device=device)
            plan.decode_rows = torch.tensor([starts[i] for i in seqs], device=device)
        max_seq_len = max(meta.seq_lens_cpu[i] for i in seqs)
        plan.decode_args = (meta.block_table[seq_idx], meta.seq_lens[seq_idx], max_seq_len)
    return plan


def paged_attention_mixed(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode=None,
    prefill=None,
    window: int = 0,
    softcap: float = 0.0,
    plan: MixedPlan | None = None,
) -> torch.Tensor:
    """Decoding sequences (one query each) batched together; prefill sequences batched by
    (query length, context length), so a burst of equal prompts is one SDPA call per layer.

    decode: the batched decode function (paged_decode_attention's signature).
    prefill: optional fn(query, k_cache, v_cache, meta, seqs, starts, scale, out, window,
    softcap) that writes the rows of every sequence in `seqs` (all those with more than one
    query) in one call. window and softcap as in paged_attention. plan: mixed_plan(meta), when
    the caller keeps the step's.
    """
    decode = decode or paged_decode_attention
    plan = plan or mixed_plan(meta, query.device)
    out = torch.empty_like(query)
    starts = plan.starts
    if prefill and plan.prefill_seqs:
        prefill(query, k_cache, v_cache, meta, plan.prefill_seqs, starts, scale, out, window,
                softcap)
    elif not prefill:
        for seqs in plan.groups.values():
            if len(seqs) == 1:
                i = seqs[0]
                attend_one(query, k_cache, v_cache, meta, i, starts[i], scale, out, window,
                           softcap)
            else:
                attend_group(query, k_cache, v_cache, meta, seqs, starts, scale, out, window,
                             softcap)
    if len(plan.decode_seqs) == 1:
        i = plan.decode_seqs[0]
        attend_one(query, k_cache, v_cache, meta, i, starts[i], scale, out, window, softcap)
    elif plan.decode_seqs:
        rows = plan.decode_rows
        out[rows] = decode(
            query[rows], k_cache, v_cache, *plan.decode_args, scale, window=window,
            softcap=softcap,
        )
    return out


def attend_group(
    query, k_cache, v_cache, meta, seqs: list[int], starts, scale, out,
    window: int = 0, softcap: float = 0.0,
) -> None:
    """Prefill sequences with equal query and context lengths: one gather, one SDPA (their
    windows start at the same position, so they skip the same leading blocks)."""
    n, q_len, kv_len = len(seqs), meta.query_lens_cpu[seqs[0]], meta.seq_lens_cpu[seqs[0]]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    dev = query.device
    first = torch.tensor([starts[i] for i in seqs], device=dev)
    rows = (first[:, None] + torch.arange(q_len, device=dev)).reshape(-1)  # [n * q_len]
    q = query[rows].view(n, q_len, num_heads, head_dim).transpose(1, 2)  # [n, H, q_len, D]
    first = first_visible_block(kv_len - q_len, window, block_size)
    num_blocks = -(kv_len // -block_size)
    seq_idx = torch.tensor(seqs, device=dev)
    blocks = meta.block_table[seq_idx, first:num_blocks].reshape(-1).long()
    kv_shape = (n, (num_blocks - first) * block_size, num_kv_heads, head_dim)
    k_len = kv_len - first * block_size
    k = k_cache.index_select(0, blocks).view(kv_shape)[:, :k_len].transpose(1, 2)
    v = v_cache.index_select(0, blocks).view(kv_shape)[:, :k_len].transpose(1, 2)
    fresh = q_len == kv_len and window <= 0
    mask = None
    if not fresh:
        mask = bottom_right_causal_mask(q_len, kv_len, dev, window, first * block_size)
    o = attention(q, k, v, mask, scale, softcap, fresh)
    out[rows] = o.transpose(1, 2).reshape(n * q_len, num_heads, head_dim)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """All sequences at once: one gather of their blocks and one SDPA under a length mask.

    The query heads of one KV head group become that group's query rows, so GQA needs no
    repeat of K/V: q [B, Hkv, G, D] against k [B, Hkv, L, D]. With a window each row gathers
    from the block holding its first visible key (seq_len - window), never the blocks before.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(max_seq_len // -block_size)
    first = torch.zeros_like(seq_lens)  # [B] first block each row reads
    if window > 0:
        first = (seq_lens - window).clamp(min=0) // block_size
        num_blocks = min(num_blocks, (window + block_size - 2) // block_size + 1)
    cols = first[:, None].long() + torch.arange(num_blocks, device=query.device)  # [B, nb]
    last = (seq_lens.long() - 1).clamp(min=0) // block_size  # [B] each row's last block
    cols = torch.minimum(cols, last[:, None])  # never past a row's own blocks: masked below
    blocks = block_table.gather(1, cols).reshape(-1).long()  # [B * nb]
    kv_shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)
    k_pos = first[:, None] * block_size + torch.arange(k.shape[2], device=query.device)
    mask = k_pos < seq_lens[:, None]  # [B, L]
    if window > 0:
        mask &= k_pos >= seq_lens[:, None] - window
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = attention(q, k, v, mask[:, None, None, :], scale, softcap)
    return o.reshape(num_seqs, num_heads, head_dim)


class TorchAttentionBackend(AttentionBackend):
    """The reference backend: decoding sequences take the batched path, prefill sequences the
    grouped SDPA of paged_attention_mixed. Subclasses swap in kernels for write_kv, decode and
    prefill (pagedserve_kernels/cpu_backend.py)."""

    name = "torch"
    supports_sliding_window = True
    supports_softcap = True
    # (meta, mixed_plan(meta)) of the step running: built by its first layer, reused by the rest
    # (where consecutive layers read different metadata objects, one per KV group, each switch
    # rebuilds it)
    _mixed: tuple | None = None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_by_slot(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ):
        shared = meta.decode_shared_blocks
        if meta.is_decode_only:
            return self.decode(
                query, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.max_seq_len, scale,
                shared, window=window, softcap=softcap,
            )
        applies = self._prefill_kernel_applies(query, k_cache, meta, window, softcap)
        prefill = self.prefill if applies else None
        decode = functools.partial(self.decode, shared_blocks=shared) if shared else self.decode
        plan = self._mixed
        if plan is None or plan[0] is not meta:  # the step's first layer
            plan = self._mixed = (meta, mixed_plan(meta, query.device))
        return paged_attention_mixed(
            query, k_cache, v_cache, meta, scale, decode, prefill, window, softcap, plan[1]
        )

    def _prefill_kernel_applies(
        self, query, k_cache, meta: AttentionMetadata, window: int = 0, softcap: float = 0.0
    ) -> bool:
        """Whether prefill() takes this batch's prefill sequences; the reference has none."""
        return False

    def prefill(
        self, query, k_cache, v_cache, meta, seqs: list[int], starts, scale, out, window=0,
        softcap=0.0,
    ) -> None:
        raise NotImplementedError  # only where _prefill_kernel_applies

    def decode(
        self, query, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale, shared_blocks=0,
        window: int = 0, softcap: float = 0.0,
    ):
        """shared_blocks: leading entries of block_table common to every row (a shared prefix);
        a cascade kernel may read them once, the reference reads each row's blocks."""
        return paged_decode_attention(
            query, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale, window, softcap
        )
