"""Does llama.cpp read our Qwen2.5-VL test files as transformers' model? The tiny random
Qwen2.5-VL of tests/test_gguf_qwen2_5_vl_mmproj.py as a `qwen2vl` text GGUF plus a
`qwen2.5vl_merger` mmproj (tests/gguf_writer.py), served by llama-server (bench/.llamacpp/bin)
with --mmproj, and the same prompt and image through transformers' generate and pagedserve's
engine: greedy tokens per image, and how many of the three agree.

Images are 112x196 (multiples of 28 inside the token limits), so both sides keep the size:
llama.cpp resizes with its own bicubic code and transformers with Pillow's, whose pixels differ
for a resized image. The
text GGUF given to llama.cpp carries one unused merge (llama.cpp refuses a BPE vocabulary
without merges; the byte tokenizer has none and no prompt here can use it).

  python bench/qwen_vl_mmproj_llamacpp.py [--images 6] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_BIN = ROOT / "bench" / ".llamacpp" / "bin" / "llama-server"
sys.path.insert(0, str(ROOT / "tests"))


def build(root: Path) -> None:
    import gguf
    import test_gguf_qwen2_5_vl_mmproj as t
    from gguf_writer import write_gguf, write_qwen2_5_vl_mmproj

    hf = t.build_dir(root / "hf")
    text = t._text_folder(hf, root / "text-hf")
    write_gguf(text, root / "text.gguf", "qwen2vl", "Tiny Qwen2.5-VL", tokenizer=t._tokenizer())
    write_qwen2_5_vl_mmproj(hf, root / "mmproj.gguf")
    plain = gguf.GGUFWriter.add_chat_template

    def with_merge(self, template):
        plain(self, template)
        self.add_token_merges(["Ā ā"])  # bytes 0x00 0x01: never in a prompt here

    gguf.GGUFWriter.add_chat_template = with_merge
    try:
        write_gguf(text, root / "text-llamacpp.gguf", "qwen2vl", "Tiny", tokenizer=t._tokenizer())
    finally:
        gguf.GGUFWriter.add_chat_template = plain


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def llamacpp_tokens(server: Path, root: Path, images: list, prefix: str, suffix: str) -> list:
    from conftest import free_port

    port = free_port()
    cmd = [str(server), "-m", str(root / "text-llamacpp.gguf"), "--mmproj"]
    cmd += [str(root / "mmproj.gguf"), "--host", "127.0.0.1", "--port", str(port), "-c", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                marker = json.loads(urllib.request.urlopen(base + "/props").read())["media_marker"]
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            prompt = {"prompt_string": prefix + marker + suffix}
            prompt["multimodal_data"] = [base64.b64encode(buf.getvalue()).decode()]
            body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": True}
            out.append(post(base + "/completion", body | {"cache_prompt": False})["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--llama-server", type=Path, default=LLAMACPP_BIN)
    args = ap.parse_args()
    if not args.llama_server.is_file():
        sys.exit(f"{args.llama_server} is missing: bash bench/install_llamacpp.sh")
    with tempfile.TemporaryDirectory(prefix="qwen-vl-mmproj-") as tmp:
        compare(Path(tmp), args)


def compare(root: Path, args) -> None:
    from test_qwen2_5_vl import generate, hf_greedy, random_image

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    build(root)
    images = [random_image(seed, (112, 196)) for seed in range(args.images)]
    # llama.cpp's mtmd wraps the image in <|vision_start|> ... <|vision_end|> itself
    theirs = llamacpp_tokens(args.llama_server, root, images, "hi", "what?")
    cfg = dict(model=str(root / "text.gguf"), mmproj=str(root / "mmproj.gguf"), dtype="float32")
    engine = LLMEngine(EngineConfig(**cfg, device="cpu", max_model_len=512))
    mm = engine.mm_processor
    agree = {"pagedserve=transformers": 0, "llama.cpp=transformers": 0}
    for n, (image, lcpp) in enumerate(zip(images, theirs)):
        ids = engine.tokenizer.encode("hi" + mm.image_token + "what?")
        ids, inputs = mm.expand(ids, [mm.pixels(image, "image")])
        ours = generate(engine, {"r": (ids, inputs)})["r"]
        ref = hf_greedy(root / "hf", ids, inputs)
        agree["pagedserve=transformers"] += ours == ref
        agree["llama.cpp=transformers"] += lcpp == ref
        print(json.dumps({"image": n, "transformers": ref, "pagedserve": ours, "llama.cpp": lcpp}))
    print(json.dumps({k: f"{v}/{len(images)}" for k, v in agree.items()}))


if __name__ == "__main__":
    main()
