"""--quantization int8 (vLLM's name): W8A8 linears for Hugging Face checkpoints.

At load each decoder-layer Linear (attention and MLP projections; not the embedding or lm_head,
which stay in the model dtype) has its weight quantized per output channel, symmetric:

    w_scale[n] = max_k |W[n, k]| / 127        W_q[n, k] = round(W[n, k] / w_scale[n])

and the float weight is dropped. At every call each row (token) of x is quantized the same way
(dynamic per-token scales), the int8 x int8 dot runs in int32 (exact), and

    y[m, n] = float(dot(x_q[m], W_q[n])) * (x_scale[m] * w_scale[n]) + bias[n]

is rounded once to x's dtype. On CPU the C++ kernel (pagedserve_kernels/csrc/quant_linear.cpp,
int8_linear: AVX-512 VNNI or its portable loop) runs it on a packed copy; elsewhere the torch path
below (same math, float32 sums of the integers) does.

    mark_quantized(model, "int8")   # apply.py, before select_impls: Linear.select() binds int8

--quantization gguf: a model folder converted from a GGUF file serves its quantized linears
packed (gguf.py; apply.py marks them); the same Linear.select() seam binds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_CPU, INT8_NATIVE = "int8_cpu", "int8_native"  # Linear.impl once quantized
LANES, GROUP = 16, 4  # the packed layout: 16 output channels x 4 consecutive k per vector


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (W_q int8 [N, K], w_scale float32 [N]); an all-zero row gets scale 1."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], x_scale float32 [M]); the kernel's rounding exactly
    (a float32 division, round half to even); an all-zero row has scale 0 and x_q 0."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    q = torch.round(xf / scale[:, None]).clamp_(-127, 127)
    q = torch.where(scale[:, None] > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def pack_int8_weight(q: torch.Tensor) -> torch.Tensor:
    """W_q [N, K] -> [ceil(N/16), ceil(K/4), 16, 4], zero padded (int8_linear's layout)."""
    n, k = q.shape
    np_, kp = -(-n // LANES) * LANES, -(-k // GROUP) * GROUP
    padded = F.pad(q, (0, kp - k, 0, np_ - n))
    return padded.view(np_ // LANES, LANES, kp // GROUP, GROUP).permute(0, 2, 1, 3).contiguous()


class Int8Weights(nn.Module):
    """A Linear's weight as W8A8: what forward needs and nothing else (the float weight is gone).

    ops: the CPU kernels (the packed copy and int8_linear), or None (W_q kept for the torch path).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, self.w_scale = quantize_weight(weight)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops
        if ops is not None:
            self.packed = pack_int8_weight(q)
            # vpdpbusd takes x as q + 128: the kernel subtracts 128 * sum_k W_q[n, k]
            self.w_sum = q.sum(dim=1, dtype=torch.int32)
            self.qweight = None
        else:
            self.qweight = q

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.ops is not None:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            out = x2.new_empty(x2.shape[0], self.out_features)
            self.ops.int8_linear(out, x2, self.packed, self.w_scale, self.w_sum, self.bias)
        else:
            out = self.forward_native(x2)
        return out.view(*shape[:-1], self.out_features)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The same math in torch: integer sums in float32 (exact while they stay below 2^24)."""
        q, x_scale = quantize_per_token(x)
        dot = F.linear(q.float(), self.qweight.float())
        y = dot * (x_scale[:, None] * self.w_scale[None, :])
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def num_bytes(self) -> int:
        """Bytes this layer's weights hold (quantized weight, scales, sums, bias)."""
        held = [self.packed if self.ops is not None else self.qweight, self.w_scale]
        held += [self.w_sum] if self.ops is not None else []
        held += [self.bias] if self.bias is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def select_int8(linear: nn.Module, ops) -> None:
    """Binds linear (an engine.layers.Linear marked by mark_quantized) to its int8 weights."""
    assert linear.quantization == "int8", linear.quantization
    on_cpu = linear.weight.device.type == "cpu"
    kernel_ops = ops if ops is not None and on_cpu else None
    linear.quant = Int8Weights(linear.weight, linear.bias, kernel_ops)
    linear.impl = INT8_CPU if kernel_ops is not None else INT8_NATIVE
    linear.ops, linear.packed = kernel_ops, None
    linear.weight, linear.bias = None, None  # the float copy is freed (a tied one stays)
    linear.forward = linear.quant.forward
