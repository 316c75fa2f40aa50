"""Gemma 3 from GGUF with llama.cpp's `gemma3` mmproj (`--mmproj`): a tiny random
Gemma3ForConditionalGeneration written as llama.cpp ships it, a `gemma3` text GGUF (its vocabulary
holding <start_of_image>, <image_soft_token>, <end_of_image>) plus a `clip` mmproj of projector
type gemma3 named as convert_hf_to_gguf.py's Gemma3VisionModel names things
(tests/gguf_writer.py write_gemma3_mmproj); greedy float32 tokens equal transformers' generate on
the original model, and wrong files are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_byte_tokenizer, tiny_config
from gguf_writer import write_gemma3_mmproj, write_gguf
from test_gemma3_vision import SPECIALS, generate, hf_greedy, image_prompt, random_image

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model

IMAGE_TOKENS = 16
# llama.cpp's Gemma 3 text side: every 6th layer global (the file carries no per-layer pattern)
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def _tokenizer():
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def build_gemma3_dir(path, seed: int = 0):
    """SigLIP 2 layers of 32 over 32x32 images in 4-pixel patches (8x8 pooled 2x2: 16 tokens,
    scale factor 2), a 6-layer Gemma 3 text side of 64 (window 8); the projection F16-exact,
    as the converter stores it in F16."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _tokenizer()
    boi, image, eoi = tok.convert_tokens_to_ids(SPECIALS)
    text = tiny_config(tok, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    text |= dict(layer_types=LAYER_TYPES, num_hidden_layers=6, model_type="gemma3_text")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, image_size=32)
    vision |= dict(num_attention_heads=4, patch_size=4, vision_use_head=False)
    vision |= dict(model_type="siglip_vision_model")
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name and p.dim() > 1 or "mm_input_projection" in name:
                p.normal_(0, 0.3)
            elif "norm" in name and "vision_tower" not in name:
                p.normal_(0, 3.0)
            if "mm_input_projection" in name:
                p.copy_(p.half().float())
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _text_folder(vl_dir, out):
    """The text side as a Gemma3ForCausalLM folder (what llama.cpp's text GGUF holds)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((vl_dir / "config.json").read_text())["text_config"]
    config["architectures"] = ["Gemma3ForCausalLM"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    state = {}
    for name, weight in load_file(str(vl_dir / "model.safetensors")).items():
        for prefix in ("model.language_model.", "language_model.model."):  # both layouts
            if name.startswith(prefix):
                state["model." + name.removeprefix(prefix)] = weight
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            state["lm_head.weight"] = weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the transformers Gemma 3 folder, text.gguf, mmproj.gguf)."""
    root = tmp_path_factory.mktemp("gemma3-mmproj")
    hf = build_gemma3_dir(root / "hf")
    text = _text_folder(hf, root / "text-hf")
    write_gguf(text, root / "text.gguf", "gemma3", "Tiny Gemma 3", tokenizer=_tokenizer())
    write_gemma3_mmproj(hf, root / "mmproj.gguf")
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


def _engine(text, mmproj, **kw) -> LLMEngine:
    cfg = dict(model=str(text), mmproj=str(mmproj), dtype="float32", device="cpu")
    return LLMEngine(EngineConfig(**(cfg | {"max_model_len": 512} | kw)))


def test_joined_folder_is_gemma3(files):
    hf, text, mmproj = files
    config = json.loads((resolve_model(str(text), str(mmproj)) / "config.json").read_text())
    want = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    for key in ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index"):
        assert config[key] == want[key], key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "image_size"):
        assert config["vision_config"][key] == want["vision_config"][key], key
    assert config["vision_config"]["hidden_act"] == want["vision_config"]["hidden_act"]
    assert config["text_config"]["layer_types"] == LAYER_TYPES


def test_text_gguf_plus_gemma3_mmproj_matches_transformers(files):
    """Pixels of the folder's processor, the tower + projector's embeddings, and greedy tokens
    for one and two images equal transformers' on the original model."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    hf_dir, text, mmproj = files
    engine = _engine(text, mmproj)
    image = random_image(1)
    ours = engine.mm_processor.pixels(image, "image")
    theirs = AutoImageProcessor.from_pretrained(hf_dir)(images=[image], return_tensors="pt")
    assert torch.equal(ours, theirs["pixel_values"][0])
    hf = Gemma3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.model.get_image_features(ours[None]).pooler_output
        got = engine.runner.model.embed_images(ours[None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    prompts = {
        "one": image_prompt(engine, "what is this?", [random_image(1)]),
        "two": image_prompt(engine, "compare", [random_image(2, (48, 32)), random_image(3)]),
    }
    # "\n\n<start_of_image>" + 16 soft tokens + "<end_of_image>\n\n" between the texts
    assert len(prompts["one"][0]) == len("hi") + 3 + IMAGE_TOKENS + 3 + len("what is this?")
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf_dir, *prompt), rid
    assert got["one"] != got["two"]


def test_refusals(files, tmp_path):
    """Missing keys, a projector for another width, a scale that does not pool the grid, a
    text GGUF of another family, a vocabulary without the image tokens."""
    hf, text, mmproj = files
    cases = {
        "clip.vision.image_mean missing": {"clip.vision.image_mean": None},
        "clip.vision.patch_size missing": {"clip.vision.patch_size": None},
        "scale_factor 3 does not pool the 8x8": {"clip.vision.projector.scale_factor": 3},
    }
    for i, (message, overrides) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.gguf"
        write_gemma3_mmproj(hf, bad, **overrides)
        with pytest.raises(ValueError, match=message):
            resolve_model(str(text), str(bad))
    wide = tmp_path / "wide.gguf"  # the tower says 48 wide, its projector reads 32
    write_gemma3_mmproj(hf, wide, **{"clip.vision.embedding_length": 48})
    with pytest.raises(ValueError, match=r"64-wide embeddings from 32-wide patches.*width 48"):
        resolve_model(str(text), str(wide))
    plain = tmp_path / "plain.gguf"  # the byte vocabulary alone: no <start_of_image>
    write_gguf(_text_folder(hf, tmp_path / "plain-hf"), plain, "gemma3", "Plain")
    with pytest.raises(ValueError, match="has no <start_of_image> token"):
        resolve_model(str(plain), str(mmproj))
    from conftest import build_tiny_model_dir

    llama = tmp_path / "llama.gguf"  # a Llama text model whose vocabulary has the tokens
    src = build_tiny_model_dir(tmp_path / "llama-hf", vocab_size=len(_tokenizer()))
    write_gguf(src, llama, "llama", "Llama", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match="goes with a Gemma 3 text GGUF, not 'llama'"):
        resolve_model(str(llama), str(mmproj))


def test_server_with_gemma3_mmproj_answers_like_transformers(files):
    """`pagedserve serve text.gguf --mmproj mmproj.gguf`, the official openai client with two
    data: URLs: the reply's tokens are transformers' greedy continuation."""
    from conftest import ServerProcess
    from openai import OpenAI
    from test_multimodal import data_url, png_bytes, url_part

    hf_dir, text, mmproj = files
    server = ServerProcess(
        str(text), "--mmproj", str(mmproj), "--dtype", "float32", "--served-model-name", "g"
    )
    images = [random_image(11), random_image(12, (24, 64))]
    try:
        client = OpenAI(base_url=server.wait_ready().url + "/v1", api_key="x")
        content = [url_part(data_url(png_bytes(image))) for image in images]
        content.append({"type": "text", "text": "what?"})
        reply = client.chat.completions.create(
            model="g", messages=[{"role": "user", "content": content}], max_tokens=8,
            temperature=0.0, logprobs=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        server.stop()
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
    # the logprobs too (they move with the image even where the argmax does not)
    got = torch.tensor([t.logprob for t in reply.choices[0].logprobs.content])
    torch.testing.assert_close(got, _hf_logprobs(hf_dir, ids, inputs, want), atol=1e-3, rtol=0)


def _hf_logprobs(hf_dir, ids: list[int], inputs: list, new: list[int]) -> torch.Tensor:
    """transformers' logprob of each token of `new` after ids (+ the images)."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids + new])
    with torch.inference_mode():
        logits = model(
            input_ids=x, pixel_values=torch.stack([i.pixel_values for i in inputs]),
            token_type_ids=(x == model.config.image_token_id).long(),
        ).logits[0, len(ids) - 1 : -1]  # fmt: skip
    return logits.log_softmax(-1).gather(1, torch.tensor(new)[:, None])[:, 0]


def test_q8_text_gguf_plus_gemma3_mmproj(files, tmp_path):
    """The usual shipment: a quantized text GGUF beside the mmproj. float32 equals transformers'
    Gemma 3 on the same dequantized text weights; bf16 serves the text linears from the packed
    Q8_0 blocks."""
    import shutil

    import gguf
    from safetensors.numpy import load_file, save_file

    hf_dir, _, mmproj = files
    text = tmp_path / "q8.gguf"
    write_gguf(
        _text_folder(hf_dir, tmp_path / "q8-hf"), text, "gemma3", "Q8",
        gguf.GGMLQuantizationType.Q8_0, tokenizer=_tokenizer(),
    )  # fmt: skip
    joined = resolve_model(str(text), str(mmproj))
    ref = tmp_path / "ref"  # the Gemma 3 with the text side's dequantized weights
    shutil.copytree(hf_dir, ref)
    state = load_file(str(ref / "model.safetensors"))
    state = {n: w for n, w in state.items() if not n.startswith("language_model.")}
    for name, weight in load_file(str(joined / "model.safetensors")).items():
        state["language_model." + name] = weight  # the classic layout transformers reads
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    engine = _engine(text, mmproj)
    prompt = image_prompt(engine, "q8", [random_image(6)])
    assert generate(engine, {"q": prompt})["q"] == hf_greedy(ref, *prompt)
    engine = _engine(text, mmproj, dtype="bfloat16")
    packed = [
        n for n, m in engine.runner.model.named_modules()
        if getattr(m, "quantization", None) == "gguf"
    ]  # fmt: skip
    assert len(packed) == 6 * 4 + 1  # qkv, o, gate_up, down per layer (fused), and the head
    assert len(generate(engine, {"b": image_prompt(engine, "q8", [random_image(6)])})["b"]) == 8
