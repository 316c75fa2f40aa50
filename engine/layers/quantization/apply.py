"""Which linears of a loaded model run quantized, and one start-up line that says so.

    mark_quantized(model, "int8")   # before select_impls: Linear.select() then binds int8
    mark_gguf(model, model_dir)     # a folder converted from GGUF: its packed blocks

Marking sets `Linear.quantization` (and, for GGUF, the packed parts); `Linear.select()` binds the
weights (int8.py, gguf.py). This module is the one that walks a model's Linears.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine.config import QUANTIZATION_METHODS
from engine.distributed import get_tp
from engine.gguf.convert import BLOCKS_FILE
from engine.layers.linear import Linear
from engine.layers.quantization.gguf import (
    GGUF_PACKED_ENV,
    GGUF_TYPES,
    GGUFDispatch,
    GGUFWeights,
    pack_parts,
    packed_max_rows,
    packed_mode,
)
from pagedserve_kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger(__name__)


def mark_quantized(model: nn.Module, method: str | None, model_dir=None,
                   gguf_weights: str = "auto") -> int:
    """Marks every Linear inside model.model.layers for `method`; returns how many.

    Embedding and lm_head (a tied lm_head shares the embedding's tensor) are left as they are.
    method None on a GGUF folder: its linears as gguf_weights says (gguf_mode); method "gguf":
    packed (mark_gguf)."""
    if method is None:
        return 0 if model_dir is None else mark_gguf(model, model_dir, gguf_weights)
    if method == "gguf":
        if model_dir is None or not (Path(model_dir) / BLOCKS_FILE).is_file():
            raise ValueError(
                f"quantization 'gguf' needs a .gguf model; {model_dir} holds no GGUF blocks"
            )
        return mark_gguf(model, model_dir, "packed", flag="--quantization gguf")
    if method not in QUANTIZATION_METHODS:
        supported = list(QUANTIZATION_METHODS)
        raise ValueError(f"quantization must be one of {supported}, got {method!r}")
    count = 0
    for module in model.model.layers.modules():
        if isinstance(module, Linear):
            module.quantization = method
            count += 1
    return count


def describe_quantized(model: nn.Module) -> str:
    """One start-up line: how many linears run int8, on which kernel, and their weight bytes."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
    quantized = [m for m in linears if getattr(m, "quant", None) is not None]
    if any(isinstance(getattr(m, "quant", None), GGUFWeights) for m in [*linears, model.lm_head]):
        return describe_gguf(model)
    kernel = quantized[0].ops.int8_kernel() if quantized and quantized[0].ops else "torch"
    mb = linear_weight_bytes(model)["int8"] / 2**20
    return (
        f"int8: {len(quantized)} of {len(linears)} decoder linears on the {kernel} kernel, "
        f"{mb:.1f} MiB of weights; embedding and lm_head stay in the model dtype"
    )


def linear_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the decoder layers' linear weights as they are held now, by kind:
    int8 (Int8Weights.num_bytes), gguf (GGUFWeights.num_bytes) and float (weight and bias
    elements at their dtype; a packed bf16 linear counts one copy, its logical size)."""
    sizes = {"int8": 0, "gguf": 0, "float": 0}
    for module in model.model.layers.modules():
        if not isinstance(module, Linear):
            continue
        quant = getattr(module, "quant", None)
        if quant is not None:
            sizes["gguf" if isinstance(quant, GGUFWeights) else "int8"] += quant.num_bytes()
        if quant is not None and module.packed is not None:  # --gguf-weights auto's copy
            sizes["float"] += 2 * module.in_features * module.out_features
        elif quant is None:
            elem = 2 if module.packed is not None else module.weight.element_size()
            sizes["float"] += module.in_features * module.out_features * elem
            if module.packed is not None and module.packed.bias is not None:
                sizes["float"] += module.out_features * elem
            elif module.bias is not None:
                sizes["float"] += module.bias.numel() * elem
    return sizes


# ---- which tensors of a model folder are served packed ------------------------------------------
def gguf_mode(model: nn.Module, gguf_weights: str, flag: str | None = None) -> tuple[str, str]:
    """(packed | dense | auto, why) for a GGUF folder's linears. $PAGEDSERVE_GGUF_PACKED 1 or 0
    wins (packed, dense); packed blocks live on one CPU rank only; auto is dense in float32
    (the exact path: transformers' greedy tokens) and without the CPU kernels."""
    env = packed_mode()
    if env != "auto":
        return ("packed" if env == "on" else "dense"), f"${GGUF_PACKED_ENV}"
    param = next(model.parameters())
    if gguf_weights != "dense" and (get_tp().world_size > 1 or param.device.type != "cpu"):
        # the packed tensors live on the CPU, and the linears bind without the all-reduce
        return "dense", "packed weights are served on one CPU rank only"
    if gguf_weights != "auto":
        return gguf_weights, flag or f"--gguf-weights {gguf_weights}"
    if param.dtype == torch.float32:
        return "dense", "float32 is the exact path (greedy tokens equal transformers')"
    ops = load_cpu_ops()
    if ops is None:
        return "dense", "no CPU kernels for the packed blocks"
    max_rows = packed_max_rows(ops)
    dtype = str(param.dtype).replace("torch.", "")
    if max_rows is None or param.dtype != torch.bfloat16:
        return "packed", (f"auto: the {ops.gguf_kernel()} kernel beat dense {dtype} at "
                          "every row count measured, 1-512 (bench/micro/gguf_crossover.py)")
    return "auto", f"auto: packed up to {max_rows} rows, dense above"


def mark_gguf(model: nn.Module, model_dir: Path, gguf_weights: str = "auto",
              flag: str | None = None) -> int:
    """Marks the Linears of model (decoder layers and lm_head) whose GGUF blocks model_dir holds
    in a type of GGUF_TYPES, with their parts (and under auto, gguf_dense: keep a dense copy
    too); returns how many. Nothing when the folder has no BLOCKS_FILE or gguf_mode says dense.
    The start-up log says which and why. Tensors of other types stay dequantized (a log line)."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return 0
    mode, why = gguf_mode(model, gguf_weights, flag)
    model.gguf_weights = (mode, why)  # describe_gguf's line
    if mode == "dense":
        logger.info("gguf: weights dense (dequantized), %s", why)
        return 0
    from safetensors import safe_open

    marked, skipped = 0, {}
    with safe_open(str(path), framework="pt") as f:
        types = f.metadata() or {}
        for name, module in _packable(model):
            sources = _sources(name, types)
            if sources is None:
                continue
            bad = [types[s] for s in sources if types[s] not in GGUF_TYPES]
            if bad:
                for s in sources:
                    skipped[s] = types[s]
                continue
            parts = pack_parts([(types[s], f.get_tensor(s).numpy()) for s in sources])
            if sum(p.out_features for p in parts) != module.out_features or any(
                p.in_features != module.in_features for p in parts
            ):
                raise ValueError(f"{path}: GGUF blocks of {name} do not match its shape")
            module.quantization, module.gguf_parts = "gguf", parts
            module.gguf_dense = mode == "auto"
            marked += 1
    if skipped:
        kinds = sorted(set(skipped.values()))
        logger.info(
            "gguf: %d tensors of type %s dequantized (packed: %s)",
            len(skipped), ", ".join(kinds), ", ".join(GGUF_TYPES),
        )
    if mode == "packed":
        _tie_embedding(model)  # under auto the embedding keeps its table, as the dense head
    return marked


def _packable(model: nn.Module):
    """(name, Linear) for the decoder layers' linears and the lm_head."""
    for name, module in model.named_modules():
        inside = name.startswith("model.layers.") or name == "lm_head"
        if inside and isinstance(module, Linear):
            yield name, module


def _sources(name: str, types: dict[str, str]) -> list[str] | None:
    """The GGUF tensors (HF names) a Linear's rows come from, in order; None if not all kept."""
    base, _, leaf = name.rpartition(".")
    if name == "lm_head":
        names = ["lm_head.weight"] if "lm_head.weight" in types else ["model.embed_tokens.weight"]
    elif f"{name}.weight" in types:
        names = [f"{name}.weight"]
    elif leaf == "qkv_proj":
        names = [f"{base}.{p}_proj.weight" for p in "qkv"]
    elif leaf == "gate_up_proj":
        names = [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"]
    else:
        return None
    return names if all(n in types for n in names) else None


def _tie_embedding(model: nn.Module) -> None:
    """A tied lm_head served packed: the embedding gathers its rows from the same parts and its
    float table goes. Only when a decoder linear is packed too (then nothing else, such as the
    fused decode step, reads the table)."""
    head = model.lm_head
    embed = model.model.embed_tokens
    tied = head.weight is not None and head.weight is embed.weight
    layers_packed = any(
        getattr(m, "gguf_parts", None) for n, m in _packable(model) if n != "lm_head"
    )
    if getattr(head, "gguf_parts", None) is None or not tied or getattr(embed, "tp_size", 1) > 1:
        return
    if not layers_packed:
        head.quantization, head.gguf_parts = None, None
        return
    part, dtype = head.gguf_parts[0], embed.weight.dtype
    embed.gguf = part
    embed.weight = None
    embed.forward = lambda input_ids: part.gather_rows(input_ids, dtype, load_cpu_ops())


def describe_gguf(model: nn.Module) -> str:
    """One start-up line: what is packed, of which types, the kernel, MiB held vs bf16."""
    linears = [(n, m) for n, m in _packable(model) if n != "lm_head"]
    packed = [m for _, m in linears if isinstance(getattr(m, "quant", None), GGUFWeights)]
    counts: dict[str, int] = {}
    for m in packed:
        for t in m.quant.qtypes():
            counts[t] = counts.get(t, 0) + 1
    kinds = ", ".join(f"{t} x{c}" for t, c in sorted(counts.items()))
    head = model.lm_head
    head_q = getattr(head, "quant", None)
    head_note = "lm_head in the model dtype"
    if isinstance(head_q, GGUFWeights):
        tied = getattr(model.model.embed_tokens, "gguf", None) is not None
        head_note = f"lm_head {'+'.join(head_q.qtypes())} packed" + (
            " (tied: the embedding gathers its rows from it)" if tied else ""
        )
    ops = packed[0].ops if packed else None
    kernel = ops.gguf_kernel() if ops is not None else "torch"
    mods = packed + ([head] if isinstance(head_q, GGUFWeights) else [])
    held = sum(m.quant.num_bytes() for m in mods) / 2**20
    bf16 = sum(2 * m.in_features * m.out_features for m in mods) / 2**20
    mode, why = getattr(model, "gguf_weights", ("packed", "--quantization gguf"))
    line = (
        f"gguf: weights {mode} ({why}): {len(packed)} of {len(linears)} decoder linears packed "
        f"({kinds}), {head_note}, {kernel} kernel, {held:.1f} MiB of packed weights "
        f"(bf16: {bf16:.1f} MiB)"
    )
    dispatch = [m.forward for m in mods if isinstance(m.forward, GGUFDispatch)]
    if not dispatch:
        return line
    dense = sum(dense_bytes(m.packed) for m in mods) / 2**20
    return (
        f"{line}; calls of up to {dispatch[0].max_rows} rows run on them (decode, bound by "
        f"weight bytes), larger ones on a dense bf16 copy ({dense:.1f} MiB held; prefill, "
        f"bound by compute): bench/micro/gguf_crossover.py"
    )


def dense_bytes(packed) -> int:
    """Bytes a PackedLinear holds: its oneDNN packings and its dense_linear packing."""
    held = [getattr(packed, a, None) for a in ("large", "small", "amx", "bias")]
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
