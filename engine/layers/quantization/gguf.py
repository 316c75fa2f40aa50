"""GGUF-quantized linears served packed (vLLM's `--quantization gguf`; a .gguf is served so).

The converter (engine/gguf/convert.py) keeps the raw blocks of every quantized linear beside the
float32 weights (BLOCKS_FILE in the model folder). At load each decoder Linear and the lm_head
whose GGUF tensors are of a type in GGUF_TYPES bind to GGUFWeights and drop their float copy;
a tied lm_head's embedding then gathers its rows from the same packed tensor (GGUFEmbedding).

Every type is re-packed once into one layout (pagedserve_kernels/csrc/gguf_quant.cpp has the byte
map): unsigned quants u of `bits` bits, scales per `sub` weights and, for the types with a min, mins
per 32:

    W[n, k] = s[n, k // sub] * (u[n, k] - zero)      Q8_0 (zero 128), Q4_0 (8), Q5_0 (16), Q6_K (32)
    W[n, k] = s[n, k // sub] * u[n, k] + m[n, k // 32]                    Q4_1, Q5_1, Q4_K, Q5_K

s and m are fp16 for the 32-weight types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the file's own fp16 d
and m, so nothing is lost, and Q4_0 holds 18 bytes per 32 weights as the file does) and float32
for the K types (d * sc and dmin * m are not fp16-exact). W is gguf-py's dequantization exactly
(the same float32 products, the fp16 values widened exactly). On CPU the C++ kernel
multiplies it without unpacking to memory: activations quantized per 32-block to int8, integer
dots (AVX-512 VNNI or a portable loop), one float multiply-add per block. Calls of at least
GEMM_MIN_ROWS rows (prefill chunks, batched decode) go where the CPU has AMX to gguf_gemm
(pagedserve_kernels/csrc/gguf_gemm.cpp), which dequantizes 32 channels at a time into an L2-resident
bf16 tile buffer and multiplies it on AMX: the bits of dequantize-then-bf16-matmul, summed in
another order. Without AMX the VNNI kernel takes every call (on the portable loop, calls of more
than VNNI_MAX_ROWS rows dequantize the whole weight to x's dtype and run one matmul).
--gguf-weights auto keeps a dense copy for calls above packed_max_rows(ops) where that wins
(GGUFDispatch). Elsewhere (other devices, no kernels) forward_native dequantizes and runs F.linear.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve_kernels.cpu_linear import AMX_MAX_ROWS, PackedLinear

logger = logging.getLogger(__name__)

LANES, BLOCK = 16, 32
# Where the CPU has AMX, calls of at least this many rows run gguf_gemm, fewer the integer
# kernel (bench/micro/gguf_gemm.py measures both against bf16 weights at M = 8..256). The fused
# decode step has the same rule in C++ (pagedserve_kernels/csrc/ops.h kGgufGemmMinRows).
GEMM_MIN_ROWS = 16
# Without AMX, on the portable integer loop: calls of more than this many rows dequantize the
# whole weight and run one matmul. The AVX-512 VNNI kernel takes every row count: at 512 rows it
# took 0.50-0.66x the time of the whole-weight dequantize and 0.75x that of dense bf16
# (bench/micro/gguf_crossover.py, numbers below).
VNNI_MAX_ROWS = 256
GGUF_PACKED_ENV = "PAGEDSERVE_GGUF_PACKED"  # unset: --gguf-weights decides; 1 packed; 0 dense
# --gguf-weights auto (the default for a GGUF on CPU): calls of up to packed_max_rows(ops) rows
# run on the packed blocks (decode: bound by the weight's bytes), larger ones on a dense bf16
# copy the linear keeps beside them (prefill: bound by compute); None: every call packed, no copy.
# bench/micro/gguf_crossover.py, every linear of the 30-layer default model (SmolLM2-135M, Q4_1;
# lm_head Q8_0) and of 4 layers of a Llama-3.2-1B shape, weights out of cache as when serving,
# one thread, CPU clock, AMD EPYC Zen 4 without AMX (2026-12-05), packed VNNI / dense bf16 time:
#   135M layers M = 1: 0.55, 4: 0.62, 16: 0.76, 32: 0.78, 64: 0.70, 128: 0.73, 256: 0.74-0.76,
#   512: 0.75 (1.50 with the whole-weight dequantize); lm_head 0.52 .. 0.75, 512: 0.75 (1.98)
#   1B layers M = 1: 0.45-0.48, 32: 0.71-0.74, 256: 0.75-0.76, 512: 0.77 (1.58 dequantizing)
# so on VNNI there is no crossover: packed wins at every row count and auto holds no dense copy.
# With AMX the dense copy runs on AMX tiles: gguf_gemm took 2.2x its time at 32 rows even with
# the weight in cache, and VNNI and gguf_gemm tie at 8 rows (bench/results/HISTORY.md,
# 2026-12-01), hence packed up to 8 rows there; on the portable loop (neither) up to 32 (decode
# batches). Neither was re-measured out of cache: run gguf_crossover.py on such a CPU.
PACKED_MAX_ROWS: int | None = None  # AVX-512 VNNI without AMX
PACKED_MAX_ROWS_AMX = 8
PACKED_MAX_ROWS_PORTABLE = 32


@dataclass(frozen=True)
class QuantType:
    block: int  # weights per GGUF block
    nbytes: int  # bytes per GGUF block
    bits: int  # bits of u in the re-packed layout
    zero: int | None  # u - zero is the signed quant; None: the type has a min instead
    sub: int = 32  # weights per scale

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp16 where s and m are the file's fp16 d and m themselves (exact); float32 for the
        K types, whose d * sc products need up to 17 significant bits."""
        return torch.float16 if self.block == BLOCK else torch.float32


GGUF_TYPES = {
    "Q8_0": QuantType(32, 34, 8, 128),
    "Q4_0": QuantType(32, 18, 4, 8),
    "Q4_1": QuantType(32, 20, 4, None),
    "Q5_0": QuantType(32, 22, 5, 16),
    "Q5_1": QuantType(32, 24, 5, None),
    "Q4_K": QuantType(256, 144, 4, None),
    "Q5_K": QuantType(256, 176, 5, None),
    "Q6_K": QuantType(256, 210, 6, 32, sub=16),
}


def packed_mode() -> str:
    """$PAGEDSERVE_GGUF_PACKED: auto (packed when --quantization gguf asks), 1 or 0."""
    value = os.environ.get(GGUF_PACKED_ENV, "auto").lower()
    if value in ("1", "true", "on"):
        return "on"
    return "off" if value in ("0", "false", "off") else "auto"


# ---- raw GGUF blocks -> (u, scales, mins) -------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> [...] float32
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] -> [..., 32]: low nibbles then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bit(qh: np.ndarray) -> np.ndarray:  # [..., 4] little-endian bits -> [..., 32] of 0/1
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def unpack_blocks(
    qtype: str, raw: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """raw [N, row_bytes] uint8 GGUF blocks -> (u [N, K] uint8, scales [N, K // sub] float32,
    mins [N, K // 32] float32 or None)."""
    t = GGUF_TYPES[qtype]
    n = raw.shape[0]
    b = raw.reshape(n, -1, t.nbytes)
    mins = None
    if qtype == "Q8_0":
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scales = _f16(b[..., 0:2])
    elif qtype in ("Q4_0", "Q5_0"):
        scales = _f16(b[..., 0:2])
        off = 2 if qtype == "Q4_0" else 6
        u = _nibbles(b[..., off : off + 16])
        if qtype == "Q5_0":
            u = u | (_high_bit(b[..., 2:6]) << 4)
    elif qtype in ("Q4_1", "Q5_1"):
        scales, mins = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        off = 4 if qtype == "Q4_1" else 8
        u = _nibbles(b[..., off : off + 16])
        if qtype == "Q5_1":
            u = u | (_high_bit(b[..., 4:8]) << 4)
    elif qtype in ("Q4_K", "Q5_K"):
        u, scales, mins = _unpack_k45(qtype, b)
    elif qtype == "Q6_K":
        u, scales = _unpack_q6k(b)
    else:
        raise ValueError(f"GGUF type {qtype} is not served packed")
    return u.reshape(n, -1), scales.reshape(n, -1), None if mins is None else mins.reshape(n, -1)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit scales and mins of a Q4_K/Q5_K block -> 8 of each."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), mn.astype(np.float32)


def _unpack_k45(qtype: str, b: np.ndarray):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., -128:].reshape(*b.shape[:2], 4, 32)  # 4 chunks of 64 weights
    u = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:2], 8, 32)
    if qtype == "Q5_K":
        qh = b[..., 16:48]  # bit j of byte l: weight l of sub-block j
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        u = u | (((qh[..., None, :] >> shifts) & 1) << 4)
    return u, d * sc, -(dmin * mn)


def _unpack_q6k(b: np.ndarray):
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None]
    lead = b.shape[:2]
    low = ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(*lead, 2, 4, 32)
    high = qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    u = low | ((high & 3) << 4)
    return u.reshape(*lead, 256), d * sc


# ---- the re-packed layout ---------------------------------------------------------------------
class PackedQuant(nn.Module):
    """One weight [N, K] of one type in the kernel layout (buffers qs, qh, scales, mins)."""

    def __init__(self, qtype: str, u: np.ndarray, scales: np.ndarray, mins) -> None:
        super().__init__()
        t = GGUF_TYPES[qtype]
        self.qtype, self.bits, self.sub = qtype, t.bits, t.sub
        self.zero = 0 if t.zero is None else t.zero
        self.out_features, self.in_features = u.shape
        n, k = u.shape
        g = -(-n // LANES)
        u = np.pad(u, ((0, g * LANES - n), (0, 0)))
        # ug[g, b, v, l * 4 + j]: channel 16g + l, k = 32b + 4v + j
        ug = torch.from_numpy(u).view(g, LANES, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
        ug = ug.reshape(g, k // BLOCK, 8, 64)
        if t.bits == 8:
            self.qs = ug.contiguous()
        else:
            self.qs = ((ug[:, :, :4] & 0x0F) | ((ug[:, :, 4:] & 0x0F) << 4)).contiguous()
        self.qh = None
        if t.bits == 5:
            bit = (ug >> 4) & 1
            self.qh = sum(bit[:, :, v] << v for v in range(8)).unsqueeze(2).to(torch.uint8)
        elif t.bits == 6:
            two = (ug >> 4) & 3
            vecs = [sum(two[:, :, 4 * h + s] << (2 * s) for s in range(4)) for h in range(2)]
            self.qh = torch.stack(vecs, dim=2).to(torch.uint8).contiguous()
        self.scales = _group_rows(scales, g, t.scale_dtype)
        self.mins = None if mins is None else _group_rows(mins, g, t.scale_dtype)

    def quants(self) -> torch.Tensor:
        """u [N, K] uint8, unpacked again (the torch path)."""
        ug = _decode(self.qs, self.qh, self.bits)  # [G, B, 8, 64]
        g, b = ug.shape[:2]
        u = ug.view(g, b, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(g * LANES, b * BLOCK)
        return u[: self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] as gguf-py dequantizes it (float32 products), then in dtype."""
        s = _ungroup_rows(self.scales, self.out_features)
        m = None if self.mins is None else _ungroup_rows(self.mins, self.out_features)
        return self._combine(self.quants(), s, m).to(dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids of W (an embedding lookup): [T] -> [T, K], gathered then dequantized."""
        g, lane = ids // LANES, ids % LANES

        def rows(t: torch.Tensor) -> torch.Tensor:  # [G, B, V, 64] -> [T, B, V, 4]
            return t.view(*t.shape[:3], LANES, 4)[g, :, :, lane]

        qh = None if self.qh is None else rows(self.qh)
        u = _decode(rows(self.qs), qh, self.bits).reshape(len(ids), self.in_features)
        s = self.scales[g, :, lane]  # [T, K // sub]
        m = None if self.mins is None else self.mins[g, :, lane]
        return self._combine(u, s, m).to(dtype)

    def gather_rows(self, ids: torch.Tensor, dtype: torch.dtype, ops=None) -> torch.Tensor:
        """dequantize_rows' bits, on the C++ kernel where ops (pagedserve_kernels.cpu_ops) has it:
        one call instead of a dozen torch ops (one row: 14-24 us against 82-95 alone)."""
        if ops is None or ids.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return self.dequantize_rows(ids, dtype)
        out = torch.empty(len(ids), self.in_features, dtype=dtype)
        ops.gguf_dequantize_rows(out, ids.long().contiguous(), self.qs, self.qh, self.scales,
                                 self.mins, self.out_features, self.bits, self.zero)
        return out

    def _combine(self, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        n, k = u.shape
        u = u.float().reshape(n, k // self.sub, self.sub)
        s = s.float()  # fp16 scales widen exactly
        m = None if m is None else m.float()
        if m is None:
            return (s[..., None] * (u - self.zero)).reshape(n, k)
        return ((s[..., None] * u).reshape(n, k // BLOCK, BLOCK) + m[..., None]).reshape(n, k)

    def num_bytes(self) -> int:
        held = [t for t in (self.qs, self.qh, self.scales, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def linear(self, x: torch.Tensor, out: torch.Tensor, bias, ops) -> None:
        """out [M, N] = x [M, K] @ W^T (+ bias) on the C++ kernels."""
        rows = x.shape[0]
        if rows >= GEMM_MIN_ROWS and gemm_available(ops):
            ops.gguf_gemm(out, x, self.qs, self.qh, self.scales, self.mins, self.bits, self.zero,
                          bias)
            return
        if rows > VNNI_MAX_ROWS and ops.gguf_kernel() != "avx512_vnni":
            w = x.new_empty(self.out_features, self.in_features)
            ops.gguf_dequantize(w, self.qs, self.qh, self.scales, self.mins, self.bits, self.zero)
            out.copy_(F.linear(x, w, bias))
            return
        ops.gguf_linear(out, x, self.qs, self.qh, self.scales, self.mins, self.bits, self.zero,
                        bias)

    def extra_repr(self) -> str:
        return f"{self.qtype}, out={self.out_features}, in={self.in_features}"


@functools.cache
def gemm_available(ops) -> bool:
    """Whether ops has gguf_gemm and this build and process may run it (AMX-BF16)."""
    return hasattr(ops, "gguf_gemm_available") and bool(ops.gguf_gemm_available())


def _decode(qs: torch.Tensor, qh: torch.Tensor | None, bits: int) -> torch.Tensor:
    """qs [..., 4 or 8, L], qh [..., 1 or 2, L] -> u [..., 8, L] (the kernel's byte map)."""
    if bits == 8:
        return qs
    u = torch.cat([qs & 0x0F, qs >> 4], dim=-2)
    if bits == 5:
        u = u | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    elif bits == 6:
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)
        high = (qh.unsqueeze(-2) >> shifts) & 3  # [..., 2, 4, L]: vector 4h + t
        u = u | (high.reshape(u.shape) << 4)
    return u


def _group_rows(a: np.ndarray, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, S] float32 -> [G, S, 16] of dtype, channels padded with zeros to 16 per group.
    Refuses values dtype does not hold exactly (the served bits must stay gguf-py's)."""
    n, s = a.shape
    a = np.pad(a.astype(np.float32), ((0, groups * LANES - n), (0, 0)))
    t = torch.from_numpy(a).view(groups, LANES, s).permute(0, 2, 1).contiguous()
    held = t.to(dtype)
    if not torch.equal(torch.nan_to_num(held.float()), torch.nan_to_num(t)):
        raise ValueError(f"GGUF scales are not exact in {dtype}")
    return held


def _ungroup_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    g, s, _ = t.shape
    return t.permute(0, 2, 1).reshape(g * LANES, s)[:n]


# ---- the Linear binding -------------------------------------------------------------------------
GGUF_CPU, GGUF_NATIVE, GGUF_AUTO = "gguf_cpu", "gguf_native", "gguf_auto"  # Linear.impl


class GGUFWeights(nn.Module):
    """A Linear's weight as packed GGUF parts: consecutive row ranges of one type each (a fused
    q/k/v or gate/up whose GGUF tensors have different types keeps one part per type).

    ops: the CPU kernels, or None (forward_native: dequantize, then F.linear in float32)."""

    def __init__(self, parts: list[PackedQuant], bias: torch.Tensor | None, ops=None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.ops is None:
            out = self.forward_native(x2)
        else:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            out = x2.new_empty(x2.shape[0], self.out_features)
            start = 0
            for part in self.parts:
                n = part.out_features
                bias = None if self.bias is None else self.bias[start : start + n]
                part.linear(x2, out[:, start : start + n], bias, self.ops)
                start += n
        return out.view(*shape[:-1], self.out_features)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.cat([p.dequantize(torch.float32) for p in self.parts]).to(x.device)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), w, bias).to(x.dtype)

    def num_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(p.num_bytes() for p in self.parts) + bias

    def qtypes(self) -> list[str]:
        return [p.qtype for p in self.parts]

    def extra_repr(self) -> str:
        types = "+".join(self.qtypes())
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


def select_gguf(linear: nn.Module, ops) -> None:
    """Binds linear (marked by mark_gguf, its parts in linear.gguf_parts) to GGUFWeights; one
    marked with gguf_dense (--gguf-weights auto) keeps a dense copy too (GGUFDispatch)."""
    on_cpu = linear.gguf_parts[0].qs.device.type == "cpu"
    kernel_ops = ops if ops is not None and on_cpu else None
    linear.quant = GGUFWeights(linear.gguf_parts, linear.bias, kernel_ops)
    linear.gguf_parts = None
    linear.impl = GGUF_CPU if kernel_ops is not None else GGUF_NATIVE
    linear.ops, linear.packed = kernel_ops, None
    linear.forward = linear.quant.forward
    max_rows = None if kernel_ops is None else packed_max_rows(kernel_ops)
    if getattr(linear, "gguf_dense", False) and max_rows is not None:
        # the dense weight's decode packing (dense_linear) only where the packed blocks leave
        # it decode-sized calls (AMX); without AMX it takes prefill-sized calls only
        dense_ops = kernel_ops if max_rows < AMX_MAX_ROWS else None
        linear.packed = PackedLinear(linear, dense_ops, small=False)
        linear.impl = GGUF_AUTO
        linear.forward = GGUFDispatch(linear.quant, linear.packed, max_rows)
    linear.weight, linear.bias = None, None  # the float copy is freed (a tied one stays)


def packed_max_rows(ops) -> int | None:
    """--gguf-weights auto: the most rows a call runs on the packed blocks; None: every call."""
    if gemm_available(ops):
        return PACKED_MAX_ROWS_AMX
    return PACKED_MAX_ROWS if ops.gguf_kernel() == "avx512_vnni" else PACKED_MAX_ROWS_PORTABLE


class GGUFDispatch:
    """A linear's forward under --gguf-weights auto: calls of up to max_rows rows on the packed
    GGUF blocks (quant), more on the dense packed bf16 weight (dense)."""

    def __init__(self, quant: GGUFWeights, dense: nn.Module, max_rows: int) -> None:
        self.quant, self.dense, self.max_rows = quant, dense, max_rows

    def weights_for(self, rows: int) -> str:
        return "packed" if rows <= self.max_rows else "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.max_rows:
            return self.quant(x)
        shape = x.shape
        out = self.dense(x.reshape(rows, shape[-1]))
        return out.view(*shape[:-1], out.shape[-1])


def pack_parts(tensors: list[tuple[str, np.ndarray]]) -> list[PackedQuant]:
    """Consecutive tensors of one type fuse into one part (their rows concatenated)."""
    parts: list[PackedQuant] = []
    i = 0
    while i < len(tensors):
        j = i
        while j < len(tensors) and tensors[j][0] == tensors[i][0]:
            j += 1
        qtype = tensors[i][0]
        unpacked = [unpack_blocks(qtype, raw) for _, raw in tensors[i:j]]
        u = np.concatenate([x[0] for x in unpacked])
        s = np.concatenate([x[1] for x in unpacked])
        m = None if unpacked[0][2] is None else np.concatenate([x[2] for x in unpacked])
        parts.append(PackedQuant(qtype, u, s, m))
        i = j
    return parts
