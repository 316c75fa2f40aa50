"""The CPU C++ kernels' attention backend: KV writes, decode, prefill, cascade, fused decode.

Built on the reference backend (pagedserve_kernels/reference.py): the same batching, with the
kernels of pagedserve_kernels/cpu_ops.py in place of its gathers and SDPA calls. The paged decode
kernel takes every decode batch; in bf16 where AMX or AVX-512 BF16 is available the prefill kernel
takes every sequence with more than one new token, and the cascade kernel decodes over a shared
prefix. fused_decode() runs a whole decode step through every layer in one call (ops.decode_layers;
ops.decode_layers_mixed where GGUF-packed linears are among them). The thresholds below are
chosen by measurement: bench/README.md says how to rerun it (bench/micro/cpu_ab.py).

Batch invariance (pagedserve_kernels.cpu_ops.batch_invariant(), `--batch-invariant`): the decode
kernel and the prefill kernel reduce a query's keys in different orders, and the cascade merges two
partial softmaxes, so which one a query meets (a decode step, a one-token prefill chunk, a
shared prefix in the batch) would change its bits. In this mode every query, decode rows too,
goes through the prefill kernel, whose per-query result depends on nothing else in the step,
and the cascade is off; bench/batch_invariance.py measures the check and the cost.
"""

from __future__ import annotations

import torch

from pagedserve_kernels.backend import AttentionMetadata, DecoderStack, FusedDecodeStep, QuantLinear
from pagedserve_kernels.cpu_ops import batch_invariant as batch_invariant_default
from pagedserve_kernels.reference import TorchAttentionBackend

# Decode batches whose sequences share a prefix at least this long, this many of them, read it
# once for all (the cascade kernel); below either, the one-pass decode kernel is as fast.
CASCADE_MIN_TOKENS = 128
CASCADE_MIN_SEQS = 8
# Prefill at head_dim 256 takes the AMX kernel while each query reads at most this many keys (a
# window no longer, or a context no longer); past it SDPA is faster (bench/micro/attention_decode.py
# --window-case, "prompt of ctx" at full attention). The same bound holds for every head_dim
# above PREFILL_LONG_MAX_HEAD_DIM (160 to 224 too, unmeasured there: kept as at 256).
PREFILL_D256_MAX_KEYS = 2048
# head_dims up to this one prefill on the AMX kernel at any context (bench/micro/attention_decode.py
# --head-dim-case).
PREFILL_LONG_MAX_HEAD_DIM = 128
# Decode steps up to this many sequences run every layer in one kernel call (ops.decode_layers);
# dense_linear takes every decode-sized call up to here (pagedserve_kernels/cpu_linear.py
# AMX_MAX_ROWS).
FUSED_DECODE_MAX_ROWS = 32


class CpuAttentionBackend(TorchAttentionBackend):
    """ops: the loaded kernels (pagedserve_kernels.cpu_ops.load_cpu_ops()). Named "torch" as the
    CLI's --attention-backend torch is, on CPU, these kernels over the reference."""

    name = "torch"
    supports_cascade = True
    supports_fused_decode = True

    def __init__(self, ops, batch_invariant: bool | None = None) -> None:
        """batch_invariant: None reads pagedserve_kernels.cpu_ops.batch_invariant()."""
        self.ops = ops
        self.batch_invariant = batch_invariant_default() if batch_invariant is None else (
            batch_invariant
        )
        self._prefill_supported: dict[tuple[int, int], bool] = {}
        self._cascade_supported: dict[tuple[int, int, int], bool] = {}
        # the prefill kernel's per-step arguments, built by the first layer, reused by the others
        self._prefill_args: tuple | None = None

    def forward(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ):
        """Batch-invariant: every sequence, decode rows too, in one call of the prefill kernel."""
        if self.batch_invariant and self._prefill_kernel_applies(
            query, k_cache, meta, window, softcap
        ):
            out = torch.empty_like(query)
            seqs = list(range(meta.num_seqs))
            starts = meta.query_start_loc.tolist()
            self.prefill(query, k_cache, v_cache, meta, seqs, starts, scale, out, window, softcap)
            return out
        return super().forward(query, k_cache, v_cache, meta, scale, window, softcap)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if k_cache.device.type == "cpu":
            self.ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
        else:
            super().write_kv(key, value, k_cache, v_cache, slot_mapping)

    def _prefill_kernel_applies(
        self, query, k_cache, meta: AttentionMetadata, window: int = 0, softcap: float = 0.0
    ) -> bool:
        """bf16 on CPU, query rows [T, H, D] with heads contiguous, shapes the kernel covers
        (window and softcap are the kernel's too); a head_dim above PREFILL_LONG_MAX_HEAD_DIM up
        to PREFILL_D256_MAX_KEYS."""
        if query.shape[2] > PREFILL_LONG_MAX_HEAD_DIM and not 0 < window <= PREFILL_D256_MAX_KEYS:
            if meta.max_seq_len > PREFILL_D256_MAX_KEYS:
                return False
        if query.device.type != "cpu" or query.dtype != torch.bfloat16:
            return False
        if k_cache.dtype != torch.bfloat16 or query.stride(1) != query.shape[2]:
            return False
        return self.prefill_shapes_supported(query.shape[2], k_cache.shape[1])

    def prefill_shapes_supported(self, head_dim: int, block_size: int) -> bool:
        key = (head_dim, block_size)
        if key not in self._prefill_supported:
            self._prefill_supported[key] = bool(self.ops.prefill_supported(*key))
        return self._prefill_supported[key]

    def prefill(
        self, query, k_cache, v_cache, meta, seqs: list[int], starts, scale, out, window=0,
        softcap=0.0,
    ) -> None:
        """All prefill sequences in one call of the prefill kernel, K/V read from the cache."""
        cached = self._prefill_args
        if cached is None or cached[0] is not meta or cached[1] != seqs:  # once per step
            idx = torch.tensor(seqs, dtype=torch.long)
            args = (
                meta.block_table.index_select(0, idx),
                torch.tensor([starts[i] for i in seqs], dtype=torch.int32),
                torch.tensor([meta.query_lens_cpu[i] for i in seqs], dtype=torch.int32),
                torch.tensor([meta.seq_lens_cpu[i] for i in seqs], dtype=torch.int32),
            )
            cached = self._prefill_args = (meta, list(seqs), args)
        self.ops.paged_attention_prefill(
            out, query, k_cache, v_cache, *cached[2], scale, window, softcap
        )

    def decode(
        self, query, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale, shared_blocks=0,
        window: int = 0, softcap: float = 0.0,
    ):
        """With enough shared_blocks and sequences the cascade kernel reads the prefix once."""
        if query.device.type != "cpu":
            args = (block_table, seq_lens, max_seq_len, scale, 0, window, softcap)
            return super().decode(query, k_cache, v_cache, *args)
        out = query.new_empty(query.shape)
        plan = self.cascade_plan(
            query.shape[1], query.dtype, k_cache, block_table, seq_lens, shared_blocks, window,
            softcap,
        )
        if plan is not None:
            self.ops.paged_attention_cascade(out, query, k_cache, v_cache, *plan, scale)
            return out
        self.ops.paged_attention_decode(
            out, query, k_cache, v_cache, block_table, seq_lens, scale, window, softcap
        )
        return out

    def cascade_plan(
        self, num_heads, dtype, k_cache, block_table, seq_lens, shared_blocks: int,
        window: int = 0, softcap: float = 0.0,
    ):
        """A plan when the cascade kernel takes this decode batch: a shared prefix of
        CASCADE_MIN_TOKENS over CASCADE_MIN_SEQS sequences, bf16, shapes the AMX kernel covers,
        full attention without a cap (a window would skip the prefix anyway); never when
        batch-invariant."""
        if self.batch_invariant:
            return None
        block_size = k_cache.shape[1]
        if shared_blocks * block_size < CASCADE_MIN_TOKENS or window > 0 or softcap > 0:
            return None
        if block_table.shape[0] < CASCADE_MIN_SEQS or dtype != torch.bfloat16:
            return None
        if k_cache.dtype != torch.bfloat16:
            return None
        key = (k_cache.shape[3], block_size, num_heads // k_cache.shape[2])
        if key not in self._cascade_supported:
            self._cascade_supported[key] = bool(self.ops.cascade_supported(*key))
        if not self._cascade_supported[key]:
            return None
        prefix_len = shared_blocks * block_size
        return (
            block_table[0, :shared_blocks], prefix_len, block_table[:, shared_blocks:],
            seq_lens - prefix_len,
        )

    def fused_decode(self, stack: DecoderStack) -> CpuFusedDecode | None:
        """The decode_layers step for a bf16 stack whose projections are all AMX-packed, or
        the decode_layers_mixed step where some are GGUF-packed parts (QuantLinear, on the
        CPU; the others AMX-packed); else None (the caller passes None weights for any the
        kernels do not hold); None too for a stack with a sliding window or a logit cap
        (decode_layers has neither)."""
        if stack.dtype != torch.bfloat16 or any(w is None for w in stack.layer_weights):
            return None
        if stack.window > 0 or stack.softcap > 0:
            return None
        quant = [w for w in stack.layer_weights if isinstance(w, QuantLinear)]
        if any(p.qs.device.type != "cpu" for w in quant for p in w.parts):
            return None
        return CpuFusedDecode(self, stack)


class CpuFusedDecode(FusedDecodeStep):
    """A decode step through every layer in one call of ops.decode_layers: the kernels the
    layers call, in the same order (the same bits, without the Python between them)."""

    def __init__(self, backend: CpuAttentionBackend, stack: DecoderStack) -> None:
        self.backend, self.stack = backend, stack
        # GGUF-packed projections: decode_layers_mixed's flat weights and spec, built once
        self.mixed = mixed_layout(stack.layer_weights) if stack.has_quant else None

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= FUSED_DECODE_MAX_ROWS

    @property
    def supports_lora(self) -> bool:
        return hasattr(self.backend.ops, "decode_layers_lora")

    def __call__(
        self, x, positions, cos_sin, meta: AttentionMetadata, kv_caches, lora=None
    ) -> torch.Tensor:
        """lora: (per layer a, bt of qkv, o, gate_up, down; token slots; slot scalings; max
        rank), the step's adapters (engine/layers/lora.py), or None."""
        s = self.stack
        plan = self.backend.cascade_plan(
            s.num_heads, x.dtype, kv_caches[0][0], meta.block_table, meta.seq_lens,
            meta.decode_shared_blocks,
        )
        # batch-invariant: the prefill kernel's attention for the one-token queries, where it runs
        invariant = self.backend.batch_invariant and self.backend.prefill_shapes_supported(
            s.head_dim, kv_caches[0][0].shape[1]
        )
        none = x.new_empty(0, dtype=torch.int32)
        prefix_blocks, prefix_len, suffix_table, suffix_lens = plan or (none, 0, none, none)
        caches = [c for kv in kv_caches for c in kv]
        rest = (
            s.final_norm_weight, meta.slot_mapping, meta.block_table, meta.seq_lens, prefix_len,
            prefix_blocks, suffix_table, suffix_lens, s.num_heads, s.num_kv_heads, s.head_dim,
            s.eps, s.scale, invariant,
        )
        if self.mixed is None and lora is None:
            return self.backend.ops.decode_layers(
                x, positions, cos_sin, s.layer_weights, caches, *rest
            )
        if self.mixed is None:  # adapters: the mixed step, each projection AMX-packed
            self.mixed = mixed_layout(s.layer_weights)
        weights, spec = self.mixed
        args = (x, positions, cos_sin, weights, spec, s.qkv_bias, s.qk_norm, caches, *rest)
        if lora is not None:
            return self.backend.ops.decode_layers_lora(*args, *lora)
        return self.backend.ops.decode_layers_mixed(*args)


def mixed_layout(layer_weights: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """decode_layers_mixed's (weights, spec): each QuantLinear becomes its parts' tensors (qs,
    qh, scales, mins, those it has) and spec entries [P, then n, bits, zero, has_qh, has_mins
    per part]; an AMX-packed projection stays one tensor with the entry [0]; a norm or bias is
    a tensor without an entry. A tensor projection and a norm are told apart by rank: AMX
    packings are 3-D or more, norms and biases 1-D."""
    weights: list[torch.Tensor] = []
    spec: list[int] = []
    for w in layer_weights:
        if isinstance(w, QuantLinear):
            spec.append(len(w.parts))
            for p in w.parts:
                spec += [p.out_features, p.bits, p.zero, p.qh is not None, p.mins is not None]
                weights += [t for t in (p.qs, p.qh, p.scales, p.mins) if t is not None]
        else:
            if w.dim() > 1:
                spec.append(0)
            weights.append(w)
    return weights, torch.tensor(spec, dtype=torch.int64)


def argmax_rows(ops):
    """The row argmax greedy sampling runs: the one-pass kernel on contiguous float32 rows
    (faster than torch.argmax at vocabulary sizes, bench/micro/sampler.py), else torch.argmax."""

    def kernel(logits: torch.Tensor) -> torch.Tensor:  # [N] int64
        if logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    return kernel
