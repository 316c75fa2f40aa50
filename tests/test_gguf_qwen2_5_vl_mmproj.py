"""Qwen2.5-VL from GGUF with llama.cpp's `qwen2.5vl_merger` mmproj (`--mmproj`): a tiny random
Qwen2_5_VLForConditionalGeneration written as llama.cpp ships it, a `qwen2vl` text GGUF (M-RoPE
sections in qwen2vl.rope.dimension_sections, the vocabulary holding Qwen's vision tokens) plus a
`clip` mmproj named as convert_hf_to_gguf.py's Qwen2VLVisionModel names things
(tests/gguf_writer.py write_qwen2_5_vl_mmproj: q/k/v split, the Conv3d split in two taps,
n_wa_pattern, no window size: clip.cpp's 112 pixels). Greedy float32 tokens equal transformers'
generate on the original model; wrong files are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_byte_tokenizer, tiny_config
from gguf_writer import write_gguf, write_qwen2_5_vl_mmproj
from test_qwen2_5_vl import SPECIALS, generate, hf_greedy, image_prompt, random_image

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model

PATCH, MERGE = 14, 2
AREA = (PATCH * MERGE) ** 2


def _tokenizer():
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def build_dir(path, seed: int = 0):
    """4 vision blocks of 32 (blocks 1 and 3 full attention: n_wa_pattern 2), 14-pixel patches
    merged 2x2 in windows of 112 pixels (4x4 merged tokens, transformers' and clip.cpp's
    default), a 2-layer Qwen2 text side of 64 with mrope_section [2, 3, 3]; Qwen2-VL's image
    processor between clip.cpp's 8 and 4096 merged tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer()
    ids = dict(zip(SPECIALS, tok.convert_tokens_to_ids(SPECIALS)))
    text = tiny_config(tok)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"]["mrope_section"] = [2, 3, 3]
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=PATCH)
    vision |= dict(spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112)
    vision |= dict(out_hidden_size=64, fullatt_block_indexes=[1, 3])
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # a visible image signal: larger random tower weights
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() > 1:
                p.normal_(0, 0.3)
            elif "visual" in name and "norm" not in name and "ln_q" not in name:
                p.normal_(0, 0.1)  # biases too: their q/k/v split and join is tested
    model.save_pretrained(path)
    size = {"shortest_edge": 8 * AREA, "longest_edge": 4096 * AREA}
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, size=size).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _text_folder(vl_dir, out):
    """The text side as a Qwen2 folder with the M-RoPE sections (what the qwen2vl GGUF holds)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((vl_dir / "config.json").read_text())["text_config"]
    config |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    state = {}
    for name, weight in load_file(str(vl_dir / "model.safetensors")).items():
        if name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")):
            state[name] = weight  # the classic layout transformers saves Qwen2.5-VL in
        elif name.startswith("model.language_model."):  # transformers 5's layout
            state["model." + name.removeprefix("model.language_model.")] = weight
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            state["lm_head.weight"] = weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the transformers Qwen2.5-VL folder, text.gguf, mmproj.gguf)."""
    root = tmp_path_factory.mktemp("qwen-vl-mmproj")
    hf = build_dir(root / "hf")
    text = _text_folder(hf, root / "text-hf")
    write_gguf(text, root / "text.gguf", "qwen2vl", "Tiny Qwen2.5-VL", tokenizer=_tokenizer())
    write_qwen2_5_vl_mmproj(hf, root / "mmproj.gguf")
    return hf, root / "text.gguf", root / "mmproj.gguf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of this test's own, sharing the built CPU kernels."""
    from pagedserve_kernels.cpu_ops import _cache_root

    kernels = _cache_root() / "kernels"
    (tmp_path / "cache").mkdir()
    if kernels.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))


def _engine(text, mmproj=None, **kw) -> LLMEngine:
    cfg = dict(model=str(text), mmproj=mmproj and str(mmproj), dtype="float32", device="cpu")
    return LLMEngine(EngineConfig(**(cfg | {"max_model_len": 512} | kw)))


def test_joined_folder_is_qwen2_5_vl(files):
    hf, text, mmproj = files
    config = json.loads((resolve_model(str(text), str(mmproj)) / "config.json").read_text())
    want = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert config[key] == want[key], key
    for key in (
        "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "window_size",
        "fullatt_block_indexes", "out_hidden_size", "spatial_merge_size", "hidden_act",
    ):  # fmt: skip
        assert config["vision_config"][key] == want["vision_config"][key], key
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


def test_text_gguf_plus_qwen_mmproj_matches_transformers(files):
    """Pixels of the folder's processor, the tower + merger's embeddings (a split q/k/v file
    and a fused attn_qkv one), and greedy tokens for one image (two windows), two images and
    text alone equal transformers' on the original model."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    hf_dir, text, mmproj = files
    engine = _engine(text, mmproj)
    image = random_image(1, (112, 196))
    one = image_prompt(engine, "what is this?", [image])
    assert one[1][0].grid_thw == (1, 8, 14) and one[1][0].length == 28  # 4x7: two windows
    theirs = AutoImageProcessor.from_pretrained(hf_dir)(images=[image], return_tensors="pt")
    assert torch.equal(one[1][0].pixel_values, theirs["pixel_values"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.model.get_image_features(theirs["pixel_values"], theirs["image_grid_thw"])
        want = torch.cat(list(want.pooler_output))
        got = engine.runner.model.encode_images([one[1][0].pixel_values], [(1, 8, 14)])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # summation order only
    prompts = {
        "one": one,
        "two": image_prompt(engine, "compare", [random_image(2, (60, 40)), random_image(3)]),
        "text": (engine.tokenizer.encode("plain text, no image"), []),
    }
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf_dir, *prompt), rid
    assert got["one"] != got["two"]


def test_fused_qkv_file_and_text_alone(files, tmp_path):
    """An mmproj with the fused attn_qkv loads to the same tower; the qwen2vl text GGUF without
    an mmproj serves text as Qwen2 (M-RoPE over text is plain RoPE), token for token."""
    hf_dir, text, mmproj = files
    fused = tmp_path / "fused.gguf"
    write_qwen2_5_vl_mmproj(hf_dir, fused, fused_qkv=True)
    split_engine, fused_engine = _engine(text, mmproj), _engine(text, fused)
    image = random_image(4, (84, 112))
    pixels = image_prompt(split_engine, "x", [image])[1][0]
    with torch.inference_mode():
        a = split_engine.runner.model.encode_images([pixels.pixel_values], [pixels.grid_thw])
        b = fused_engine.runner.model.encode_images([pixels.pixel_values], [pixels.grid_thw])
    assert torch.equal(a[0], b[0])
    plain = _engine(text)
    assert type(plain.runner.model).__name__ == "Qwen2ForCausalLM"
    ids = plain.tokenizer.encode("only words here")
    assert generate(plain, {"t": (ids, [])})["t"] == hf_greedy(hf_dir, ids, [])


def test_refusals(files, tmp_path):
    """A missing window pattern or patch key, a missing patch tap, a merger for another width,
    a text GGUF without M-RoPE sections, a vocabulary without Qwen's vision tokens."""
    hf, text, mmproj = files
    cases = {
        "clip.vision.n_wa_pattern missing": {"clip.vision.n_wa_pattern": None},
        "clip.vision.patch_size missing": {"clip.vision.patch_size": None},
        r"merger maps 128 to 64; the tower's merged width is 192": {
            "clip.vision.embedding_length": 48
        },
    }
    for i, (message, overrides) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.gguf"
        write_qwen2_5_vl_mmproj(hf, bad, **overrides)
        with pytest.raises(ValueError, match=message):
            resolve_model(str(text), str(bad))
    tapless = tmp_path / "tapless.gguf"  # one temporal tap of the Conv3d only
    write_qwen2_5_vl_mmproj(hf, tapless, drop=("v.patch_embd.weight.1",))
    with pytest.raises(ValueError, match=r"v.patch_embd.weight.1 \(the Conv3d's two temporal"):
        resolve_model(str(text), str(tapless))
    src = _text_folder(hf, tmp_path / "qwen2-hf")
    qwen2 = tmp_path / "qwen2.gguf"  # a plain qwen2 text GGUF: no M-RoPE sections
    write_gguf(src, qwen2, "qwen2", "Qwen2", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match="goes with a qwen2vl text GGUF"):
        resolve_model(str(qwen2), str(mmproj))
    plain = tmp_path / "plain.gguf"  # the byte vocabulary alone
    write_gguf(src, plain, "qwen2vl", "Plain")
    with pytest.raises(ValueError, match=r"has no <\|vision_start\|> token"):
        resolve_model(str(plain), str(mmproj))


def test_server_with_qwen_mmproj_answers_like_transformers(files):
    """`pagedserve serve text.gguf --mmproj mmproj.gguf`, the official openai client with two
    data: URLs: the reply's tokens are transformers' greedy continuation, and /v1/models says
    the model takes images."""
    import httpx
    from conftest import ServerProcess
    from openai import OpenAI
    from test_multimodal import data_url, png_bytes, url_part

    hf_dir, text, mmproj = files
    server = ServerProcess(
        str(text), "--mmproj", str(mmproj), "--dtype", "float32", "--served-model-name", "q"
    )
    images = [random_image(11, (112, 196)), random_image(12, (50, 90))]
    try:
        url = server.wait_ready().url
        client = OpenAI(base_url=url + "/v1", api_key="x")
        content = [url_part(data_url(png_bytes(image))) for image in images]
        content.append({"type": "text", "text": "what?"})
        reply = client.chat.completions.create(
            model="q", messages=[{"role": "user", "content": content}], max_tokens=8,
            temperature=0.0, logprobs=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        card = httpx.get(url + "/v1/models").json()["data"][0]
    finally:
        server.stop()
    assert card["input_modalities"] == ["text", "image"]
    engine = _engine(text, mmproj)
    mm = engine.mm_processor
    parts = "\n".join([mm.image_token] * 2 + ["what?"])
    chat = f"<|im_start|>user\n{parts}<|im_end|>\n<|im_start|>assistant\n"
    ids, inputs = mm.expand(engine.tokenizer.encode(chat), [mm.pixels(i, "image") for i in images])
    assert reply.usage.prompt_tokens == len(ids)
    want = hf_greedy(hf_dir, ids, inputs)
    assert [t.token for t in reply.choices[0].logprobs.content] == [
        engine.tokenizer.decode([t]) for t in want
    ]


def test_q8_text_gguf_plus_qwen_mmproj(files, tmp_path):
    """The usual shipment: a quantized text GGUF beside the mmproj. float32 equals transformers'
    Qwen2.5-VL on the same dequantized text weights; bf16 serves the text linears from the
    packed Q8_0 blocks."""
    import shutil

    import gguf
    from safetensors.numpy import load_file, save_file

    hf_dir, _, mmproj = files
    text = tmp_path / "q8.gguf"
    write_gguf(
        _text_folder(hf_dir, tmp_path / "q8-hf"), text, "qwen2vl", "Q8",
        gguf.GGMLQuantizationType.Q8_0, tokenizer=_tokenizer(),
    )  # fmt: skip
    joined = resolve_model(str(text), str(mmproj))
    ref = tmp_path / "ref"  # the Qwen2.5-VL with the text side's dequantized weights
    shutil.copytree(hf_dir, ref)
    state = load_file(str(ref / "model.safetensors"))
    state = {n: w for n, w in state.items() if n.startswith(("visual.", "model.visual."))}
    state |= load_file(str(joined / "model.safetensors"))  # model.layers.*, lm_head: classic
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    engine = _engine(text, mmproj)
    prompt = image_prompt(engine, "q8", [random_image(6, (84, 140))])
    assert generate(engine, {"q": prompt})["q"] == hf_greedy(ref, *prompt)
    engine = _engine(text, mmproj, dtype="bfloat16")
    packed = [
        n for n, m in engine.runner.model.named_modules()
        if getattr(m, "quantization", None) == "gguf"
    ]  # fmt: skip
    assert len(packed) == 2 * 4 + 1  # qkv, o, gate_up, down per text layer (fused), the head
    assert len(generate(engine, {"b": image_prompt(engine, "q8", [random_image(6)])})["b"]) == 8
