"""A text GGUF plus llama.cpp's `mmproj` GGUF (`--mmproj`) as one Hugging Face LLaVA folder in
the cache: the text folder's files (converted once by loader.py, linked here, its packed blocks
included), config.json of LlavaForConditionalGeneration (text_config from the text GGUF, the
tower from the mmproj's clip.vision.* keys), the tower and projector as mmproj.safetensors,
and preprocessor_config.json of transformers' CLIPImageProcessor at the mmproj's image size,
mean and std. engine/models/llava.py then serves it as any LLaVA folder.

The image placeholder is the text vocabulary's `<image>` token (the one a Hugging Face LLaVA
checkpoint adds and llama.cpp's text converter keeps); a vocabulary without one is refused.

A `gemma3` mmproj beside a Gemma 3 text GGUF makes a Gemma3ForConditionalGeneration folder
instead (engine/gguf/mmproj_gemma3.py): its image sequence's tokens from the vocabulary, the
Gemma 3 image processor, and engine/models/gemma3_vl.py serves it as any Gemma 3 folder; a
`qwen2.5vl_merger` mmproj beside a `qwen2vl` text GGUF a Qwen2_5_VLForConditionalGeneration
folder (engine/gguf/mmproj_qwen2_5_vl.py, served by engine/models/qwen2_5_vl.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

IMAGE_TOKEN = "<image>"
MMPROJ_WEIGHTS = "mmproj.safetensors"
_TEXT_ONLY = ("config.json", ".pagedserve-complete.json")


def build_llava_folder(text_dir: Path, mmproj_path: Path, cache: Path) -> Path:
    """The LLaVA folder of text_dir (a converted text GGUF) with mmproj_path's image side,
    made once per (text folder, mmproj file) and reused."""
    from engine.model_loader.loader import MARKER, _is_complete

    mmproj_path = Path(mmproj_path).expanduser()
    if not mmproj_path.is_file():
        raise ValueError(f"--mmproj file not found: {mmproj_path}")
    mmproj_path = mmproj_path.resolve()
    st = mmproj_path.stat()
    key = f"{text_dir}|{mmproj_path}|{st.st_size}|{st.st_mtime_ns}"
    target = cache / f"{text_dir.name}+{mmproj_path.stem}-{_digest(key)}"
    fingerprint = {"text": str(text_dir), "mmproj": mmproj_path.name, "size": st.st_size}
    if _is_complete(target, fingerprint):
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=cache))
    try:
        _write_folder(text_dir, mmproj_path, tmp)
        (tmp / MARKER).write_text(json.dumps(fingerprint))
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"pagedserve: {mmproj_path.name} joined to the text model at {target}", file=sys.stderr)
    return target


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def _write_folder(text_dir: Path, mmproj_path: Path, out: Path) -> None:
    from engine.gguf import mmproj as mm_lib
    from engine.gguf.convert import save_weights

    mm = mm_lib.MmprojFile(mmproj_path)
    text_config = json.loads((text_dir / "config.json").read_text())
    if mm.projector_type == "qwen2.5vl_merger":
        from engine.gguf import mmproj_qwen2_5_vl as qwen

        ids = _token_ids(text_dir, mmproj_path, qwen.IMAGE_TOKENS)
        config = qwen.qwen2_5_vl_config(mm, text_config, ids)
        processor = qwen.image_processor(mm)
        tensors = qwen.hf_tensors(mm)
    elif mm.projector_type == "gemma3":
        from engine.gguf import mmproj_gemma3 as gemma3

        ids = _token_ids(text_dir, mmproj_path, gemma3.IMAGE_TOKENS)
        config = gemma3.gemma3_config(mm, text_config, ids)
        processor = gemma3.image_processor(mm)
        tensors = gemma3.fix_tensors(mm_lib.hf_tensors(mm))
    else:
        tensors = mm_lib.hf_tensors(mm)
        (image_token_id,) = _token_ids(text_dir, mmproj_path, (IMAGE_TOKEN,))
        config = mm_lib.llava_config(mm, text_config, image_token_id)
        processor = mm_lib.image_processor(mm)
    for item in text_dir.iterdir():
        if item.name not in _TEXT_ONLY:
            os.symlink(item, out / item.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_weights(tensors, out / MMPROJ_WEIGHTS)
    processor.save_pretrained(out)


def _token_ids(text_dir: Path, mmproj_path: Path, tokens: tuple[str, ...]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    out = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"--mmproj {mmproj_path.name}: the text model's vocabulary has no {token} token "
                "to stand for an image's embeddings (a text GGUF converted from the vision "
                "model's Hugging Face checkpoint has one)"
            )
        out.append(int(token_id))
    return out
