"""A decode step through every decoder layer in one backend call, where the backend has one.

Built once after load, like engine/runner/cuda_graphs.py: the runner asks FusedDecode.build(model,
backend), which reads the model's layers into a pagedserve_kernels.backend.DecoderStack and asks the
backend for a step (AttentionBackend.fused_decode). It declines, and the model runs layer by
layer, unless the backend declares supports_fused_decode and every decoder layer has exactly
Llama's shape:

    input_layernorm (RMSNorm) -> self_attn {qkv_proj, o_proj: Linear without bias, attn} ->
    post_attention_layernorm (RMSNorm) -> mlp {gate_up_proj, down_proj: Linear, act_fn: SiluAndMul}

with one full-width rotary (any scaling variant: the kernel reads its cos|sin table) and one eps;
self_attn may also hold Qwen3's per-head `q_norm` and `k_norm` (RMSNorm, in every layer), which
the kernel applies before RoPE as the layers do, and qkv_proj a bias (Qwen2, in every layer),
which the kernel adds in the linear's epilogue as the layers' packed linear does. Each
projection is AMX-packed bf16 or, served packed from a GGUF (`--quantization gguf`), GGUF parts
(engine/layers/quantization/gguf.py GGUFWeights on the C++ kernels, any mix of types), which the
step multiplies with the same gguf_linear calls the layers make. Any other module inside a layer
(extra norms, experts), a bias on another linear, int8 weights or a norm subclass make it
decline.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import Attention, RMSNorm, RotaryEmbedding, SiluAndMul
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.quantization.gguf import GGUFDispatch, GGUFWeights
from pagedserve_kernels import AttentionBackend, AttentionMetadata
from pagedserve_kernels.backend import DecoderStack, FusedDecodeStep, QuantLinear, QuantPart

_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
# the model's linears at one rank (the runner builds no fused step above one)
_ATTN = {"qkv_proj": QKVParallelLinear, "o_proj": RowParallelLinear, "attn": Attention}
_ATTN_QK_NORM = {**_ATTN, "q_norm": RMSNorm, "k_norm": RMSNorm}
_MLP = {
    "gate_up_proj": MergedColumnParallelLinear,
    "down_proj": RowParallelLinear,
    "act_fn": SiluAndMul,
}


class FusedDecode:
    """step: the stack as the layers serve decode-sized calls (GGUF parts where packed). Under
    --gguf-weights auto (GGUFDispatch) a batch of more than packed_max_rows sequences runs
    dense_step (the dense copies), or layer by layer where there is none."""

    def __init__(self, model: nn.Module, step: FusedDecodeStep,
                 dense_step: FusedDecodeStep | None = None,
                 packed_max_rows: int | None = None) -> None:
        self.model, self.step = model, step
        self.dense_step, self.packed_max_rows = dense_step, packed_max_rows

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend) -> FusedDecode | None:
        if not backend.supports_fused_decode:
            return None
        stack = decoder_stack(model)
        step = None if stack is None else backend.fused_decode(stack)
        if step is None:
            return None
        max_rows = _packed_max_rows(model)
        dense = None
        if max_rows is not None:
            dense_stack = decoder_stack(model, dense=True)
            dense = None if dense_stack is None else backend.fused_decode(dense_stack)
        return cls(model, step, dense, max_rows)

    def _step(self, meta: AttentionMetadata) -> FusedDecodeStep | None:
        if self.packed_max_rows is None or meta.num_seqs <= self.packed_max_rows:
            return self.step
        return self.dense_step

    def can_run(self, meta: AttentionMetadata) -> bool:
        step = self._step(meta)
        return step is not None and step.can_run(meta)

    def run(
        self, input_ids, positions, meta: AttentionMetadata, kv_caches, lora=None
    ) -> torch.Tensor:
        """lora: the step's adapters for a step that supports_lora (engine/lora/manager.py)."""
        x = self.model.model.embed_tokens(input_ids)  # [num_seqs, hidden]
        cos_sin = self.model.rotary.cos_sin_cache(meta.max_seq_len, x.dtype)
        if lora is None:
            return self._step(meta)(x, positions, cos_sin, meta, kv_caches)
        return self._step(meta)(x, positions, cos_sin, meta, kv_caches, lora=lora)

    def supports_lora(self, meta: AttentionMetadata) -> bool:
        return self.can_run(meta) and getattr(self._step(meta), "supports_lora", False)


def _packed_max_rows(model: nn.Module) -> int | None:
    """The row limit of --gguf-weights auto's linears (GGUFDispatch), or None."""
    for module in model.model.layers.modules():
        if isinstance(getattr(module, "forward", None), GGUFDispatch):
            return module.forward.max_rows
    return None


def decoder_stack(model: nn.Module, dense: bool = False) -> DecoderStack | None:
    """model's decoder layers as a DecoderStack, or None where one is not Llama-shaped.
    dense: linears holding GGUF parts and a dense copy (--gguf-weights auto) give the copy."""
    rotary, norm = model.rotary, model.model.norm
    if not isinstance(rotary, RotaryEmbedding) or type(norm) is not RMSNorm:
        return None
    weights: list[torch.Tensor | None] = []
    eps = {norm.eps}
    attn = None
    first = model.model.layers[0].self_attn
    qk_norm = hasattr(first, "q_norm")  # the same in every layer
    first_qkv = getattr(first, "qkv_proj", None)
    qkv_bias = first_qkv is not None and _bias(first_qkv, dense) is not None
    for layer in model.model.layers:
        if not _children_are(layer, dict.fromkeys(_LAYER)):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        attn_children = _ATTN_QK_NORM if qk_norm else _ATTN
        if not _children_are(attn, attn_children) or not _children_are(mlp, _MLP):
            return None
        if any(type(n) is not RMSNorm for n in norms):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.packed is None and _gguf(m, dense) is None for m in linears):
            return None  # unpacked (not bf16 on CPU, int8): the kernels take packed weights only
        biases = [_bias(m, dense) is not None for m in linears]
        if biases != [qkv_bias, False, False, False]:
            return None  # the kernel has a bias on qkv only, in every layer or none
        eps.update(n.eps for n in norms)
        kernel = [_kernel_weight(m, dense) for m in linears]
        weights += [norms[0].weight, kernel[0]]
        if qkv_bias:  # one more weight per layer, after qkv: the kernel's layout with a bias
            weights.append(_bias(linears[0], dense))
        if qk_norm:  # two more per layer, after qkv (and its bias): the q/k norms
            weights += [attn.q_norm.weight, attn.k_norm.weight]
            eps.update((attn.q_norm.eps, attn.k_norm.eps))
        weights += [kernel[1], norms[1].weight, kernel[2], kernel[3]]
    if attn is None or len(eps) != 1 or rotary.head_dim != attn.head_dim:
        return None
    return DecoderStack(
        layer_weights=weights,
        final_norm_weight=norm.weight,
        eps=eps.pop(),
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        scale=attn.scale,
        dtype=_model_dtype(model),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The embedding table's dtype; the final norm's where a tied packed lm_head holds it."""
    table = model.model.embed_tokens.weight
    return (model.model.norm.weight if table is None else table).dtype


def _gguf(linear: nn.Module, dense: bool = False) -> GGUFWeights | None:
    """linear's GGUF-packed weights where they run on the C++ kernels, else None (and None
    under dense where the linear holds a dense copy too)."""
    quant = getattr(linear, "quant", None)
    if dense and linear.packed is not None:
        return None
    return quant if isinstance(quant, GGUFWeights) and quant.ops is not None else None


def _bias(linear: nn.Module, dense: bool = False) -> torch.Tensor | None:
    quant = _gguf(linear, dense)
    if quant is not None:
        return quant.bias
    return None if linear.packed is None else linear.packed.bias


def _kernel_weight(linear: nn.Module, dense: bool = False) -> torch.Tensor | QuantLinear | None:
    """The projection as the kernels take it: the AMX packing, or the GGUF parts."""
    quant = _gguf(linear, dense)
    if quant is None:
        return linear.kernel_weight
    return QuantLinear([
        QuantPart(p.qs, p.qh, p.scales, p.mins, p.out_features, p.bits, p.zero)
        for p in quant.parts
    ])


def _children_are(module: nn.Module, expected: dict) -> bool:
    """module's children are exactly the names in expected (of the types given, where given)."""
    children = dict(module.named_children())
    if set(children) != set(expected):
        return False
    return all(t is None or type(children[n]) is t for n, t in expected.items())
