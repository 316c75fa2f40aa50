"""A GGUF file (llama.cpp's layout) as a Hugging Face folder: config.json, float32 safetensors,
tokenizer files and generation_config.json, for each architecture in GGUF_ARCHITECTURES; and
the raw blocks of every quantized 2-D tensor, under its Hugging Face name with its type, in
BLOCKS_FILE, from which engine/layers/quantization/gguf.py serves linears packed.

llama.cpp's converter renames tensors (blk.N.attn_q, ...), interleaves the rotary halves of q/k
rows for `llama` only, stores Gemma's norm weights as 1 + weight, stacks MoE experts into one
tensor per projection, and keeps rope scaling either as metadata keys or as factor tensors
(rope_freqs for Llama 3, rope_factors_long/short for Phi-3). convert_gguf undoes each of these so
that the folder equals the Hugging Face checkpoint the file was made from (within the quant error).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from engine.gguf.families import FAMILIES, GGUF_ARCHITECTURES, Family, Meta
from engine.gguf.tokenizer import generation_config, save_tokenizer, token_ids, write_json

WEIGHTS_FILE = "model.safetensors"
BLOCKS_FILE = "gguf_blocks.bin"  # safetensors format; not *.safetensors, so not read as weights

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Stacked expert tensors [experts, out, in] -> mlp.experts.E.<proj>.weight
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Tensors that carry rope scaling, read into config.json rather than saved as weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors, tokenizer and generation config for a GGUF file."""
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    family = _family(gguf_path, meta)
    steps = len(reader.tensors) + 3
    with tqdm(total=steps, desc="convert", unit="step", file=sys.stderr) as bar:
        bar.set_description("dequantize weights")
        tensors, extras = convert_tensors(gguf_path, reader, meta, family, bar)
        bar.set_description("write weights")
        save_weights(tensors, out_dir / WEIGHTS_FILE)
        save_blocks(quantized_blocks(gguf_path, reader, meta, family), out_dir)
        bar.update()
        bar.set_description("write config")
        config = {**family.config(meta, tensors, extras), **token_ids(meta)}
        config.update(torch_dtype=_source_dtype(meta), use_cache=True)
        write_json(out_dir / "config.json", config)
        write_json(out_dir / "generation_config.json", generation_config(meta))
        bar.update()
        bar.set_description("convert tokenizer")
        save_tokenizer(gguf_path, out_dir, meta)
        bar.update()


def _source_dtype(meta: Meta) -> str:
    """The dtype the file's weights came from, which `--dtype auto` follows (engine/dtype.py):
    all-F32 files float32, F16 float16, BF16 and quantized files bfloat16 (their publishers
    quantize bf16 checkpoints). The weights themselves are written in float32 either way."""
    file_type = meta.get("general.file_type")  # llama.cpp's LLAMA_FTYPE: 0 F32, 1 F16, 32 BF16
    if file_type is None:
        return "float32"
    return {0: "float32", 1: "float16"}.get(file_type, "bfloat16")


def _family(gguf_path: Path, meta: Meta) -> Family:
    arch = meta.architecture
    if arch not in FAMILIES:
        names = ", ".join(GGUF_ARCHITECTURES)
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (supported: {names})"
        )
    return FAMILIES[arch]


def read_metadata(reader: Any) -> Meta:
    # Token tables are large and read separately by the tokenizer conversion.
    skip = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    )
    return Meta({key: f.contents() for key, f in reader.fields.items() if key not in skip})


def convert_tensors(
    gguf_path: Path, reader: Any, meta: Meta, family: Family, bar: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF name -> float32 array, rope tensor name -> array) for every tensor of the file."""
    from gguf.quants import dequantize

    heads = int(meta.arch("attention.head_count"))
    kv_heads = int(meta.arch("attention.head_count_kv", heads))
    out: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for tensor in reader.tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            msg = f"{gguf_path.name}: tensor {tensor.name} has quant type {tensor.tensor_type.name}"
            raise ValueError(f"{msg}, which gguf-py cannot dequantize") from None
        # GGUF stores dims fastest-first; numpy data is already row-major (out, in).
        array = array.astype("float32", copy=False).reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
        bar.update()
        if tensor.name in _ROPE_TENSORS:
            extras[tensor.name] = array
            continue
        if family.permute_rotary and ".attn_q." in tensor.name:
            array = _unpermute_rotary(array, heads)
        elif family.permute_rotary and ".attn_k." in tensor.name:
            array = _unpermute_rotary(array, kv_heads)
        if family.norm_offset and tensor.name.endswith("norm.weight"):
            array = array - family.norm_offset
        parts = tensor.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES:
            proj = _EXPERT_NAMES[parts[2]]
            for e, expert in enumerate(array):
                out[f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"] = expert
            continue
        out[_hf_name(gguf_path, meta, family, tensor.name)] = array
    return out, extras


def quantized_blocks(
    gguf_path: Path, reader: Any, meta: Meta, family: Family
) -> dict[str, tuple[str, Any]]:
    """HF name -> (GGUF type name, raw blocks uint8 [rows, row_bytes]) for every quantized 2-D
    tensor (rows permuted as convert_tensors permutes the dequantized ones)."""
    import numpy as np

    heads = int(meta.arch("attention.head_count"))
    kv_heads = int(meta.arch("attention.head_count_kv", heads))
    out: dict[str, tuple[str, Any]] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        if qtype in ("F32", "F16", "BF16", "F64") or len(tensor.shape) != 2:
            continue
        if tensor.name in _ROPE_TENSORS:
            continue
        rows = int(tensor.shape[1])
        raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        if family.permute_rotary and ".attn_q." in tensor.name:
            raw = _unpermute_rotary(raw, heads)
        elif family.permute_rotary and ".attn_k." in tensor.name:
            raw = _unpermute_rotary(raw, kv_heads)
        out[_hf_name(gguf_path, meta, family, tensor.name)] = (qtype, raw)
    return out


def save_blocks(blocks: dict[str, tuple[str, Any]], out_dir: Path) -> None:
    """The quantized tensors' raw blocks (safetensors format, types in the metadata), if any."""
    from safetensors.numpy import save_file

    if not blocks:
        return
    import numpy as np

    arrays = {name: np.ascontiguousarray(raw) for name, (_, raw) in blocks.items()}
    save_file(arrays, str(out_dir / BLOCKS_FILE), metadata={n: t for n, (t, _) in blocks.items()})


def _hf_name(gguf_path: Path, meta: Meta, family: Family, gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in family.layer_names:
        return f"model.layers.{parts[1]}.{family.layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    arch = meta.architecture
    raise ValueError(f"{gguf_path.name}: tensor {gguf_name!r} is not known for architecture {arch}")


def _unpermute_rotary(array: Any, heads: int) -> Any:
    # llama.cpp interleaves each head's rotary pairs; HF keeps the two halves apart.
    rows = array.shape[0]
    pairs = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return pairs.swapaxes(1, 2).reshape(array.shape).copy()


def save_weights(tensors: dict[str, Any], path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    # transformers only loads safetensors whose metadata says format=pt.
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})
