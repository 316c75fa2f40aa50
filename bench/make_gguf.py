"""The default model (or any Llama-family Hugging Face folder) as GGUF files for every peer.

Writes <name>.BF16.gguf (or F16/F32) with gguf-py's GGUFWriter: the weights, the BPE tokenizer
and chat template, and the llama.* metadata llama.cpp reads; then each quant type in --quants
through the built llama-quantize (bench/install_llamacpp.sh). pagedserve, llama-server and
vLLM then load the same file.

  python bench/make_gguf.py                                # into bench/.llamacpp/models
  python bench/make_gguf.py --quants Q8_0,Q4_0,Q4_K_M --outtype f16
  python bench/make_gguf.py --check                        # + greedy sanity through llama-server

Prints one JSON line per file (path, type, bytes); --check also starts llama-server on each
file and prints its greedy answer to one chat prompt.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LLAMACPP_BIN = Path(__file__).resolve().parent / ".llamacpp" / "bin"
DEFAULT_OUT = Path(__file__).resolve().parent / ".llamacpp" / "models"
DEFAULT_QUANTS = "Q8_0,Q4_0,Q4_1,Q4_K_M,Q6_K"

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _gguf_writer():
    """tests/gguf_writer.py: llama.cpp's tensor names, rotary row order and header keys, shared
    with the tests' GGUF files (it imports no engine code)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import gguf_writer

    return gguf_writer


def _token_types(tok: dict, vocab_size: int) -> list[int]:
    import gguf

    types = [int(gguf.TokenType.NORMAL)] * vocab_size
    for added in tok.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        if added["id"] < vocab_size:
            types[added["id"]] = int(kind)
    return types


def _pre_tokenizer_name(tok: dict) -> str:
    """llama.cpp picks its pre-tokenizer regex by name; SmolLM's (split every digit, then GPT-2
    byte-level) is `smollm`, plain byte-level is `gpt2`."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"]:
        return "gpt2"
    raise ValueError(f"unknown pre-tokenizer {kinds}: pass --tokenizer-pre")


def add_tokenizer(writer, folder: Path, vocab_size: int, pre: str | None) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    model = tok["model"]
    if model["type"] != "BPE":
        raise ValueError(f"only BPE tokenizers are written here, not {model['type']}")
    vocab = dict(model["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for text, i in vocab.items():
        if i < vocab_size:
            tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or _pre_tokenizer_name(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(_token_types(tok, vocab_size))
    writer.add_token_merges(merges)

    def token_id(key: str) -> int | None:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if value is not None else None

    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if (i := token_id(key)) is not None:
            add(i)
    writer.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    writer.add_add_space_prefix(False)
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def write_gguf(folder: Path, out: Path, outtype: str, pre: str | None = None) -> Path:
    import gguf
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"only model_type llama is written here, not {config.get('model_type')}")
    qtype = {
        "bf16": gguf.GGMLQuantizationType.BF16,
        "f16": gguf.GGMLQuantizationType.F16,
        "f32": gguf.GGMLQuantizationType.F32,
    }[outtype]
    ftype = {
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "f32": gguf.LlamaFileType.ALL_F32,
    }[outtype]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope_theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")
    if (config.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise ValueError("rope scaling is not written here")

    gw = _gguf_writer()
    gguf_name = gw.tensor_names("llama", config["num_hidden_layers"])
    tmp = out.with_suffix(".gguf.part")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(folder.name)
    gw.add_hparams(writer, config)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, folder, config["vocab_size"], pre)

    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                w = f.get_tensor(name).astype(np.float32)
                if name.endswith("self_attn.q_proj.weight"):
                    w = gw.permute_rotary(w, heads)
                elif name.endswith("self_attn.k_proj.weight"):
                    w = gw.permute_rotary(w, kv_heads)
                # llama.cpp keeps 1-D tensors (norms) in float32 whatever the file type
                t = qtype if w.ndim > 1 else gguf.GGMLQuantizationType.F32
                data = gguf.quants.quantize(w, t)
                # quantized data is uint8 shaped in bytes; the writer derives the element shape
                writer.add_tensor(gguf_name(name), data, raw_dtype=t)
    gw.write_file(writer)
    tmp.replace(out)
    return out


def quantize(src: Path, out: Path, qtype: str, binary: Path) -> Path:
    tmp = out.with_suffix(".gguf.part")
    run = subprocess.run([str(binary), str(src), str(tmp), qtype], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{run.stderr[-2000:]}")
    tmp.replace(out)
    return out


def check_llama_server(path: Path, port: int, prompt: str, max_tokens: int = 48) -> str:
    """Starts llama-server on the file, asks one greedy chat question, stops it."""
    import httpx

    proc = subprocess.Popen(
        [
            str(LLAMACPP_BIN / "llama-server"),
            "-m",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            "2048",
            "-t",
            "2",
            "--no-webui",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited:\n{proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("llama-server not ready after 300 s")
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF folder; default: pagedserve's default model")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--outtype", choices=("bf16", "f16", "f32"), default="bf16")
    p.add_argument("--quants", default=DEFAULT_QUANTS, help="comma-separated; '' for none")
    p.add_argument("--tokenizer-pre", help="llama.cpp pre-tokenizer name (default: inferred)")
    p.add_argument("--llama-quantize", type=Path, default=LLAMACPP_BIN / "llama-quantize")
    p.add_argument("--force", action="store_true", help="rewrite files that exist")
    p.add_argument("--check", action="store_true", help="greedy answer from llama-server per file")
    p.add_argument("--port", type=int, default=18990)
    args = p.parse_args(argv)

    from engine.model_loader.loader import resolve_model

    folder = Path(args.model) if args.model else resolve_model(None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"{folder.name}.{args.outtype.upper()}.gguf"
    if args.force or not base.exists():
        write_gguf(folder, base, args.outtype, args.tokenizer_pre)
    made = [(base, args.outtype.upper())]
    for q in [q.strip() for q in args.quants.split(",") if q.strip()]:
        out = args.out_dir / f"{folder.name}.{q}.gguf"
        if args.force or not out.exists():
            if not args.llama_quantize.exists():
                sys.exit(f"{args.llama_quantize} missing: run bash bench/install_llamacpp.sh")
            quantize(base, out, q, args.llama_quantize)
        made.append((out, q))
    for path, q in made:
        print(json.dumps({"path": str(path), "type": q, "bytes": path.stat().st_size}))
    if args.check:
        prompt = "Repeat the following text exactly: The quick brown fox jumps over the lazy dog."
        for path, q in made:
            answer = check_llama_server(path, args.port, prompt)
            print(json.dumps({"type": q, "llama_server_greedy": answer}))
    return [path for path, _ in made]


if __name__ == "__main__":
    main()
