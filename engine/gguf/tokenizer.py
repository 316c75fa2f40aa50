"""A GGUF file's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json), its
special token ids, and generation_config.json (every id that ends generation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.gguf.families import Meta


# ---- token ids, generation config, tokenizer -------------------------------------------------
def token_ids(meta: Meta) -> dict[str, Any]:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {hf: meta.get(f"tokenizer.ggml.{g}_token_id") for hf, g in keys.items()}


def eos_token_ids(meta: Meta) -> list[int]:
    """Every id that ends generation: EOS, end-of-turn and end-of-message, as llama.cpp stops."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _vocabulary_copy(gguf_path: Path, arch: str, folder: Path) -> Path:
    """The file's metadata without tensors, its architecture renamed to `arch` (a family
    transformers reads the vocabulary of); the tokenizer is the same."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    old = str(reader.fields["general.architecture"].contents())
    out = folder / "vocabulary.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        name = f"{arch}.{key[len(old) + 1 :]}" if key.startswith(f"{old}.") else key
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


def generation_config(meta: Meta) -> dict[str, Any]:
    out = {k: v for k, v in token_ids(meta).items() if v is not None}
    eos = eos_token_ids(meta)
    if eos:
        out["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return out


# architectures whose vocabulary transformers' GGUF reader takes under another family's name
_TOKENIZER_ALIASES = {"qwen2vl": "qwen2"}


def save_tokenizer(gguf_path: Path, out_dir: Path, meta: Meta) -> None:
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        source = gguf_path
        if meta.architecture in _TOKENIZER_ALIASES:
            source = _vocabulary_copy(gguf_path, _TOKENIZER_ALIASES[meta.architecture], Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(
            source.parent, gguf_file=source.name, local_files_only=True
        )
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
    tokenizer.save_pretrained(out_dir)
    _drop_tokens_beyond_file(out_dir, _num_file_tokens(gguf_path))
    flags = {
        flag: meta.get(f"tokenizer.ggml.{flag}")
        for flag in ("add_bos_token", "add_eos_token")
        if meta.get(f"tokenizer.ggml.{flag}") is not None
    }
    if flags:
        _set_special_token_insertion(out_dir / "tokenizer.json", meta, flags)
    max_length = int(meta.arch("context_length", 2048))
    _tidy_tokenizer_config(
        out_dir / "tokenizer_config.json", tokenizer.chat_template, max_length, flags
    )
    if tokenizer.chat_template:
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def _num_file_tokens(gguf_path: Path) -> int:
    import gguf

    return len(gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].data)


def _drop_tokens_beyond_file(out_dir: Path, num_tokens: int) -> None:
    """Added tokens past the file's token list go: transformers' Gemma tokenizer class adds a
    <mask> of its own when the file has none, and the embedding has no row for it."""
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    added = data.get("added_tokens", [])
    extra = {t["content"] for t in added if t["id"] >= num_tokens}
    if not extra:
        return
    data["added_tokens"] = [t for t in added if t["id"] < num_tokens]
    write_json(path, data)
    cfg_path = out_dir / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text())
    decoder = config.get("added_tokens_decoder", {})
    config["added_tokens_decoder"] = {i: t for i, t in decoder.items() if int(i) < num_tokens}
    for key, value in list(config.items()):
        if key.endswith("_token") and value in extra:
            config.pop(key)
    write_json(cfg_path, config)


def _set_special_token_insertion(path: Path, meta: Meta, flags: dict[str, bool]) -> None:
    """Encoding prepends BOS (appends EOS) exactly when the file says so, as llama.cpp does.

    Whether transformers' GGUF tokenizer honours tokenizer.ggml.add_bos_token depends on its
    version and tokenizer class (4.x drops the flag); written into tokenizer.json, every reader
    of the folder agrees. Gemma without its <bos> degenerates. Chat prompts are encoded without
    special tokens (the template writes <bos> itself), so they do not get a second one.
    """
    data = json.loads(path.read_text())
    vocab = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    model_vocab = data.get("model", {}).get("vocab")
    if isinstance(model_vocab, dict):
        reverse = {i: t for t, i in model_vocab.items()}
    elif isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
        reverse = dict(enumerate(p[0] for p in model_vocab))
    else:
        reverse = {}
    specials: dict[str, dict] = {}
    single: list[dict] = []
    pair: list[dict] = []
    tail_single: list[dict] = []
    tail_pair: list[dict] = []
    for flag, key, head in (("add_bos_token", "bos", True), ("add_eos_token", "eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not flags.get(flag) or token_id is None:
            continue
        token = vocab.get(int(token_id)) or reverse.get(int(token_id))
        if token is None:
            raise ValueError(f"tokenizer.ggml.{key}_token_id {token_id} is not in the vocabulary")
        specials[token] = {"id": token, "ids": [int(token_id)], "tokens": [token]}
        entry = [{"SpecialToken": {"id": token, "type_id": 0}}]
        (single if head else tail_single).extend(entry)
        (pair if head else tail_pair).extend(entry)
    template = {
        "type": "TemplateProcessing",
        "single": single + [{"Sequence": {"id": "A", "type_id": 0}}] + tail_single,
        "pair": pair
        + [{"Sequence": {"id": "A", "type_id": 0}}]
        + tail_pair
        + [{"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": specials,
    }
    # Keep a byte-level post-processor (offsets) and replace whatever inserted special tokens.
    old = data.get("post_processor")
    kept = [p for p in _post_processors(old) if p.get("type") != "TemplateProcessing"]
    procs = kept + ([template] if specials else [])
    data["post_processor"] = (
        None
        if not procs
        else procs[0]
        if len(procs) == 1
        else {"type": "Sequence", "processors": procs}
    )
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def _post_processors(proc: dict | None) -> list[dict]:
    if not proc:
        return []
    if proc.get("type") == "Sequence":
        return [p for sub in proc["processors"] for p in _post_processors(sub)]
    return [proc]


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


def _tidy_tokenizer_config(
    path: Path, chat_template: str | None, max_length: int, flags: dict[str, bool]
) -> None:
    config = json.loads(path.read_text())
    # Load-time options leak into the saved file; they mean nothing to a later reader.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    # PreTrainedTokenizerFast loads in transformers 4.x and 5.x alike (5.x aliases it).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    config.update({k: bool(v) for k, v in flags.items()})
    if chat_template:
        # Readers that only look at tokenizer_config.json (older tooling) still find it.
        config["chat_template"] = chat_template
    write_json(path, config)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
