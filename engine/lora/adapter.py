"""Reads a PEFT LoRA folder and checks it against the base model: every refusal names the file
and the tensor or config key (wrong shapes, rank above --max-lora-rank, missing files,
unsupported targets or options)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from engine.lora.request import LoRAError, LoRARequest, adapter_files

# HF module name -> (this model's fused linear, part index in it; None: the whole linear, for
# Phi-3's HF modules, fused as ours are)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "qkv_proj": ("qkv_proj", None),
    "gate_up_proj": ("gate_up_proj", None),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, HF module) -> (A [r, in], B [out, r]) in float32."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


@dataclass(frozen=True)
class BaseShapes:
    """What the base model takes: HF module name -> (in_features, out_features), and the
    modules each decoder layer has (an MoE layer has no dense gate/up/down)."""

    modules: dict[str, tuple[int, int]]
    layer_modules: list[frozenset[str]]

    @property
    def num_layers(self) -> int:
        return len(self.layer_modules)


def read_config(path) -> dict:
    config_file, _ = adapter_files(path)
    try:
        cfg = json.loads(config_file.read_text())
    except ValueError as e:
        raise LoRAError(f"{config_file}: not valid JSON ({e})") from None
    refusals = [
        ("use_dora", lambda v: bool(v), "DoRA adapters are not supported"),
        ("modules_to_save", lambda v: bool(v), "modules_to_save is not supported"),
        ("bias", lambda v: v not in (None, "none"), "only bias 'none' is supported"),
        ("rank_pattern", lambda v: bool(v), "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", lambda v: bool(v), "alpha_pattern is not supported"),
        ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out adapters are not supported"),
    ]
    for key, bad, why in refusals:
        if bad(cfg.get(key)):
            raise LoRAError(f"{config_file}: {key}={cfg.get(key)!r}: {why}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(TARGETS))
        if unsupported:
            raise LoRAError(
                f"{config_file}: target_modules {unsupported} are not supported "
                f"(supported: {sorted(TARGETS)})"
            )
    return cfg


def scaling_of(cfg: dict, rank: int) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's rule)."""
    alpha = float(cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def load_adapter(request: LoRARequest, shapes: BaseShapes, max_rank: int) -> LoRAAdapter:
    """The adapter of `request`, checked against `shapes` and --max-lora-rank."""
    cfg = read_config(request.path)
    config_file, weights_file = adapter_files(request.path)
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise LoRAError(f"{config_file}: r={rank} exceeds --max-lora-rank {max_rank}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():
            layer, module, which = _parse_key(weights_file, key, shapes)
            tensor = f.get_tensor(key).float()
            _check_shape(weights_file, key, tensor, module, which, rank, shapes)
            halves.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise LoRAError(f"{weights_file}: layer {layer} {module} has no lora_{missing} tensor")
        weights[(layer, module)] = (ab["A"], ab["B"])
    if not weights:
        raise LoRAError(f"{weights_file}: no LoRA tensors")
    return LoRAAdapter(request, rank, scaling_of(cfg, rank), weights)


def _parse_key(weights_file, key: str, shapes: BaseShapes) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise LoRAError(
            f"{weights_file}: tensor {key}: unsupported target (supported: LoRA A/B of "
            f"{sorted(TARGETS)} in the decoder layers)"
        )
    layer, module, which = int(m.group(1)), m.group(2), m.group(3)
    if module not in TARGETS:
        raise LoRAError(f"{weights_file}: tensor {key}: target module {module} is not supported")
    if module not in shapes.modules:
        raise LoRAError(
            f"{weights_file}: tensor {key}: the base model has no module {module} (its "
            f"targets: {sorted(shapes.modules)})"
        )
    if layer >= shapes.num_layers:
        raise LoRAError(
            f"{weights_file}: tensor {key}: layer {layer} does not exist in the base model "
            f"({shapes.num_layers} layers)"
        )
    if module not in shapes.layer_modules[layer]:
        raise LoRAError(
            f"{weights_file}: tensor {key}: layer {layer} of the base model has no dense "
            f"{module} (a mixture-of-experts MLP takes no adapter)"
        )
    return layer, module, which


def _check_shape(weights_file, key, tensor, module, which, rank, shapes: BaseShapes) -> None:
    n_in, n_out = shapes.modules[module]
    expected = (rank, n_in) if which == "A" else (n_out, rank)
    if tuple(tensor.shape) != expected:
        raise LoRAError(
            f"{weights_file}: tensor {key} has shape {list(tensor.shape)}, the base model "
            f"expects {list(expected)} (r={rank}, {module} is {n_in} -> {n_out})"
        )
