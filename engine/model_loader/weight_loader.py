"""Reads a folder's safetensors into a model and says, by file and tensor name, what does not fit.

A checkpoint with a missing, extra or mis-shaped tensor, or a tokenizer with more tokens than the
embedding has rows, stops start-up with a ValueError naming the file and the tensor (one line the
CLI prints) instead of a size-mismatch traceback from inside torch.

Under tensor parallelism each rank reads only its slice of a sharded tensor (safetensors'
get_slice): the layer that owns the tensor says which rows or columns (load_shard).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from engine.distributed import get_tp

_SHOWN = 3  # names listed per kind of problem; the count says how many more


def read_weights(
    model_dir: Path, model: nn.Module | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of the folder's *.safetensors (this rank's slices of the sharded ones when
    `model` is built for tensor parallelism), and the file each came from."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    sharded = model is not None and get_tp().world_size > 1
    state: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for f in files:
        try:
            tensors = _read_shards(f, model) if sharded else load_file(f)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{f.name}: not a readable safetensors file ({e})") from None
        state.update(tensors)
        sources.update(dict.fromkeys(tensors, f.name))
    return state, sources


def _read_shards(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {}
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            owner = shard_owner(model, name)
            if owner is None:  # replicated (norms, the router): read whole
                tensors[name] = f.get_tensor(name)
            else:
                module, leaf, part = owner
                tensors[name] = module.load_shard(leaf, part, f.get_slice(name)).contiguous()
    return tensors


_EXPERT = re.compile(r"(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")


def shard_owner(model: nn.Module, name: str) -> tuple[nn.Module, str, str | None] | None:
    """(the layer whose load_shard slices checkpoint tensor `name`, the parameter leaf, the part
    of a fused parameter it is: q/k/v, gate_proj/up_proj), or None for a replicated tensor."""
    name = getattr(model, "checkpoint_name", str)(name)  # a VLM's language_model.* prefixes
    prefix, _, leaf = name.rpartition(".")
    owner_path, _, proj = prefix.rpartition(".")
    expert = _EXPERT.match(prefix)
    if expert:
        module, part = _module(model, expert.group(1)), expert.group(2)
    elif proj in ("q_proj", "k_proj", "v_proj"):
        module, part = _module(model, f"{owner_path}.qkv_proj"), proj[0]
    elif proj in ("gate_proj", "up_proj"):
        module, part = _module(model, f"{owner_path}.gate_up_proj"), proj
    else:
        module, part = _module(model, prefix), None
    if module is None or not hasattr(module, "load_shard"):
        return None
    return module, leaf, part


def load_checked(model: nn.Module, model_dir: Path) -> None:
    """model.load_weights(the folder's tensors), after checking every shape against the model."""
    state, sources = read_weights(model_dir, model)
    check_shapes(model, state, sources)
    missing, unexpected = model.load_weights(state)
    problems = []
    if missing:
        problems.append(f"missing tensor {_names(missing)} (the config asks for it)")
    if unexpected:
        where = sorted({sources.get(n, "the checkpoint") for n in unexpected})
        problems.append(f"{', '.join(where)}: unexpected tensor {_names(unexpected)}")
    if problems:
        raise ValueError(f"{model_dir}: " + "; ".join(problems))


def check_shapes(model: nn.Module, state: dict[str, torch.Tensor], sources: dict[str, str]):
    """ValueError for a checkpoint tensor whose shape is not the one the config implies.

    Checked before fusing (q/k/v, gate/up, experts): a name the model holds as is must match its
    parameter; q_proj/k_proj/v_proj, gate_proj/up_proj must match their share of the fused one.
    """
    params = dict(model.named_parameters())
    for name, tensor in state.items():
        want = _expected_shape(model, params, name)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(
                f"{sources.get(name, 'checkpoint')}: tensor {name} has shape "
                f"{list(tensor.shape)}, the config implies {list(want)}"
            )


def _expected_shape(model: nn.Module, params: dict, name: str) -> tuple[int, ...] | None:
    if name in params:
        return tuple(params[name].shape)
    prefix, _, leaf = name.rpartition(".")
    owner, _, proj = prefix.rpartition(".")
    attn = _module(model, owner)
    if attn is None:
        return None
    if proj in ("q_proj", "k_proj", "v_proj") and hasattr(attn, "q_size"):
        rows = attn.q_size if proj == "q_proj" else attn.kv_size
        cols = attn.qkv_proj.in_features
        return (rows, cols) if leaf == "weight" else (rows,)
    if proj in ("gate_proj", "up_proj") and hasattr(attn, "gate_up_proj"):
        fused = attn.gate_up_proj
        if hasattr(fused, "in_features"):
            rows = fused.out_features // 2
            return (rows, fused.in_features) if leaf == "weight" else (rows,)
    return None


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def check_tokenizer(tokenizer, hf_config, model_dir: Path) -> None:
    """A tokenizer whose ids run past the embedding would index rows that do not exist."""
    num_tokens, vocab = len(tokenizer), int(hf_config.vocab_size)
    if num_tokens > vocab:
        raise ValueError(
            f"{model_dir}: the tokenizer (tokenizer.json) has {num_tokens} tokens but config.json "
            f"vocab_size is {vocab} (model.embed_tokens.weight has {vocab} rows); they do not match"
        )


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
