"""Time to first token for one image per request, at concurrency 1 and 8: pagedserve's server
against transformers (in-process, batched) and vLLM's CPU build (`vllm serve`) on one folder.

The folder: a Qwen2.5-VL-3B-shaped model with its depth cut (vision tower 1280 wide, 16 heads,
3420 MLP, patches of 14, 2x2 merge, `--vision-layers` blocks, the last full attention; text side
2048 wide, 11008 MLP, 16 heads / 2 KV heads, `--text-layers` layers, tied embeddings), random
weights in float32, a byte-level tokenizer with Qwen's vision tokens, Qwen2-VL's image processor
and a chat template. Each request carries its own random `--image-size`^2 PNG (a `data:` URL),
so no encoder-cache or prefix-cache hit helps anyone; greedy, float32.

TTFT: request sent -> answer of max_tokens=1 (servers), or the batch's first-token wall time
(transformers: the processor plus `generate(max_new_tokens=1)` over all c requests at once,
which every one of them waits for). c=1 runs three times, c=8 once (8 requests at once); the
table gives the mean and the largest TTFT of each.

    PYTHONPATH=$PWD python bench/vision.py                 # ~5 minutes on 2 loaded cores
    PYTHONPATH=$PWD python bench/vision.py --no-vllm --image-size 448

vLLM builds transformers' Qwen2.5-VL processor, whose video processor imports torchvision; the
CPU venv has none. `--vllm-pythonpath DIR` puts one on vLLM's path only (docs/benchmarks.md says
how the recorded run got one); without it the vLLM row says why it did not run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# content as a string: each server puts the image's placeholder in front of the text
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "Describe this picture in one sentence."
START_TIMEOUT_S = 900
PROMPT_TOKENS: set[int] = set()  # per server: both must see the same prompt (image tokens in)


def byte_tokenizer():
    """Every UTF-8 byte one token, Qwen's chat and vision specials on top."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + VISION)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_folder(path: Path, vision_layers: int, text_layers: int) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = byte_tokenizer()
    ids = dict(zip(VISION, tok.convert_tokens_to_ids(VISION)))
    vision = dict(
        depth=vision_layers, hidden_size=1280, intermediate_size=3420, num_heads=16,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        out_hidden_size=2048, fullatt_block_indexes=[vision_layers - 1],
    )  # fmt: skip
    text = dict(
        vocab_size=512, hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).float().eval().save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(
        path
    )
    tok.save_pretrained(path)
    return path


def png_data_urls(n: int, size: int, seed: int) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    urls = []
    for _ in range(n):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def messages(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


# ---- servers: one streamed chat request per image, c at once ------------------------------------
async def _one_ttft(client, url: str, model: str, image: str) -> float:
    """One request of max_tokens=1 (not streamed: a stream's first chunk is the role's, and a
    byte token may decode to no text): its latency is the time to the first token."""
    body = {"model": model, "messages": messages(image), "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    resp = await client.post(url + "/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    usage = resp.json()["usage"]
    PROMPT_TOKENS.add(usage["prompt_tokens"])
    assert usage["completion_tokens"] == 1, usage
    return elapsed


async def _ttfts(url: str, model: str, images: list[str]) -> list[float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(_one_ttft(client, url, model, i) for i in images)))


def serve_ttfts(url: str, model: str, size: int, conc: tuple[int, ...]) -> dict:
    asyncio.run(_ttfts(url, model, png_data_urls(2, size, seed=99)))  # warm-up
    out: dict = {}
    for c in conc:  # c=1 three times (one at a time), a fresh image each
        for r in range(3 if c == 1 else 1):
            out.setdefault(c, []).extend(asyncio.run(_ttfts(url, model, images(c, size, r))))
    return out


def images(c: int, size: int, r: int) -> list[str]:
    return png_data_urls(c, size, seed=1000 * c + r)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, port: int, log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-600:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"not ready within {START_TIMEOUT_S} s")


def run_server(name: str, cmd: list[str], env: dict, port: int, args, log: Path) -> dict | str:
    try:
        proc = start(cmd, env, port, log)
    except RuntimeError as e:
        return str(e).splitlines()[-1][:300] if str(e) else "failed to start"
    try:
        PROMPT_TOKENS.clear()
        out = serve_ttfts(f"http://127.0.0.1:{port}", name, args.image_size, args.conc)
        print(f"{log.stem}: prompt tokens {sorted(PROMPT_TOKENS)}", flush=True)
        return out
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {e}"[:300]
    finally:
        proc.terminate()
        proc.wait(60)


def run_ours(folder: Path, args, logdir: Path) -> dict | str:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", str(folder), "--dtype", "float32"]
    cmd += ["--served-model-name", "vl", "--port", str(port), "--max-model-len", "4096"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return run_server("vl", cmd, env, port, args, logdir / "ours.log")


def run_vllm(folder: Path, args, logdir: Path) -> dict | str:
    python = args.vllm_venv.absolute() / "bin" / "python"
    if not python.exists():
        return f"{args.vllm_venv} has no python"
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--served-model-name", "vl", "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--max-model-len", "4096", "--limit-mm-per-prompt"]
    cmd += [json.dumps({"image": 1, "video": 0})]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
    env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("PYTHONPATH", None)
    if args.vllm_pythonpath:  # e.g. a torchvision for its Qwen2-VL video processor's import
        env["PYTHONPATH"] = args.vllm_pythonpath
    return run_server("vl", cmd, env, port, args, logdir / "vllm.log")


# ---- transformers: the processor and generate(max_new_tokens=1) over the batch ------------------
def run_transformers(folder: Path, args) -> dict:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    proc = AutoImageProcessor.from_pretrained(folder)
    merge = proc.merge_size**2

    def first_tokens(urls: list[str]) -> float:
        t0 = time.perf_counter()
        images = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
        pix = proc(images=[im.convert("RGB") for im in images], return_tensors="pt")
        n = int(pix["image_grid_thw"][0].prod()) // merge
        text = f"{PLACEHOLDER}\n{QUESTION}".replace("<|image_pad|>", "<|image_pad|>" * n)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        batch = tok([prompt] * len(urls), return_tensors="pt", padding=True)
        with torch.inference_mode():
            model.generate(**batch, **pix, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - t0

    first_tokens(png_data_urls(2, args.image_size, seed=99))  # warm-up
    out: dict = {}
    for c in args.conc:  # every request in a batch waits for the whole batch
        for r in range(3 if c == 1 else 1):
            out.setdefault(c, []).extend([first_tokens(images(c, args.image_size, r))] * c)
    return out


def report(results: dict, args) -> None:
    ours = results["pagedserve"]
    print(f"\nTTFT (s), one {args.image_size}x{args.image_size} image per request, float32")
    head = f"{'engine':<14}" + "".join(f"{f'c={c} mean':>11}{f'c={c} max':>11}" for c in args.conc)
    print(head + "".join(f"{f'ratio c={c}':>11}" for c in args.conc))
    for name, res in results.items():
        if isinstance(res, str):
            print(f"{name:<14}not run: {res}")
            continue
        row = "".join(f"{np.mean(res[c]):>11.2f}{max(res[c]):>11.2f}" for c in args.conc)
        ratios = ""
        if not isinstance(ours, str):  # theirs / ours on the mean: > 1 means pagedserve faster
            ratios = "".join(f"{np.mean(res[c]) / np.mean(ours[c]):>11.2f}" for c in args.conc)
        print(f"{name:<14}{row}{ratios}")
    print("ratio: that engine's mean TTFT / pagedserve's (above 1: pagedserve is faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/main/bench/.venv-vllm"))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-pythonpath", help="PYTHONPATH for vLLM (a torchvision it lacks)")
    ap.add_argument("--folder", type=Path, help="reuse a folder built by an earlier run")
    args = ap.parse_args()
    args.conc = tuple(args.conc)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    cut = (args.vision_layers, args.text_layers)
    folder = args.folder or build_folder(tmp / "qwen2.5-vl-3b-cut", *cut)
    print(f"folder {folder}: Qwen2.5-VL-3B shapes, {args.vision_layers} vision / "
          f"{args.text_layers} text layers; logs in {tmp}", flush=True)  # fmt: skip
    results: dict = {}
    results["pagedserve"] = run_ours(folder, args, tmp)
    print("pagedserve", results["pagedserve"], flush=True)
    results["transformers"] = run_transformers(folder, args)
    print("transformers", results["transformers"], flush=True)
    results["vllm-cpu"] = "not run (--no-vllm)" if args.no_vllm else run_vllm(folder, args, tmp)
    print("vllm-cpu", results["vllm-cpu"], flush=True)
    report(results, args)


if __name__ == "__main__":
    main()
