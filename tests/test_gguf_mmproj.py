"""GGUF vision models with a separate mmproj file (`--mmproj`, llama.cpp's name): a tiny random
LLaVA from transformers written as llama.cpp ships it, a `llama` text GGUF (with the <image>
token) plus a `clip` mmproj GGUF of projector type mlp (tests/gguf_writer.py, the legacy
converter's names and keys), served from the two files; greedy tokens equal transformers'
generate on the original LLaVA in float32, and wrong files are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_byte_tokenizer
from gguf_writer import write_gguf, write_llava_mmproj
from test_multimodal import (
    IMAGE_TOKEN,
    build_tiny_llava_dir,
    generate,
    hf_llava_greedy,
    image_prompt,
    random_image,
)

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model


def _round_patch_embedding(model_dir) -> None:
    """The legacy converter always stores the 4-D patch embedding in F16: keep the reference's
    weights F16-exact so that the file holds the same model."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    for name, weight in state.items():
        if weight.ndim == 4:
            state[name] = weight.astype("float16").astype("float32")
    save_file(state, str(path), metadata={"format": "pt"})


def _text_folder(llava_dir, out):
    """The LLaVA's text side as a LlamaForCausalLM folder (what llama.cpp's text GGUF holds)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((llava_dir / "config.json").read_text())["text_config"]
    config["architectures"] = ["LlamaForCausalLM"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    state = {}
    text = ("model.language_model.", "language_model.model.", "language_model.lm_head.", "lm_")
    for name, weight in load_file(str(llava_dir / "model.safetensors")).items():
        if name.startswith(text[0]):
            state["model." + name[len(text[0]) :]] = weight
        elif name.startswith(text[1:]):  # the classic layout transformers saves
            state[name.removeprefix("language_model.")] = weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _replace_text(llava_dir, source_dir) -> None:
    """llava_dir's text side replaced by source_dir's (so one text GGUF serves both)."""
    from safetensors.numpy import load_file, save_file

    path = llava_dir / "model.safetensors"
    state = {n: w for n, w in load_file(str(path)).items() if "language_model" not in n}
    for name, weight in load_file(str(source_dir / "model.safetensors")).items():
        if "language_model" in name:
            state[name] = weight
    save_file(state, str(path), metadata={"format": "pt"})


def _tokenizer():
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the transformers LLaVA folder, text.gguf, mmproj.gguf), the cache in the same tmp."""
    root = tmp_path_factory.mktemp("mmproj")
    llava = build_tiny_llava_dir(root / "hf")
    _round_patch_embedding(llava)
    text = _text_folder(llava, root / "text-hf")
    write_gguf(text, root / "text.gguf", "llama", "Tiny LLaVA", tokenizer=_tokenizer())
    write_llava_mmproj(llava, root / "mmproj.gguf")
    return llava, root / "text.gguf", root / "mmproj.gguf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of this test's own, sharing the built CPU kernels (a server would rebuild)."""
    from pagedserve_kernels.cpu_ops import _cache_root

    kernels = _cache_root() / "kernels"
    (tmp_path / "cache").mkdir()
    if kernels.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))


def _engine(text, mmproj, **kw) -> LLMEngine:
    cfg = dict(model=str(text), mmproj=str(mmproj), dtype="float32", device="cpu")
    return LLMEngine(EngineConfig(**(cfg | {"max_model_len": 512} | kw)))


@pytest.mark.parametrize("variant", ["legacy-ffn", "gguf-py-ffn", "siglip"], ids=lambda v: v)
def test_text_gguf_plus_mmproj_matches_transformers(files, variant, tmp_path):
    """CLIP tower (class token dropped) with both fc1 namings; a SigLIP tower (every row)."""
    llava, text, mmproj = files
    if variant == "gguf-py-ffn":
        mmproj = tmp_path / "mmproj-gguf-py.gguf"
        write_llava_mmproj(llava, mmproj, swap_ffn=False)
    elif variant == "siglip":  # the same text model, another tower and projector
        llava = build_tiny_llava_dir(tmp_path / "siglip", seed=3, tower="siglip")
        _replace_text(llava, files[0])
        _round_patch_embedding(llava)
        mmproj = tmp_path / "mmproj-siglip.gguf"
        write_llava_mmproj(llava, mmproj)
    engine = _engine(text, mmproj)
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    theirs = AutoImageProcessor.from_pretrained(llava)
    image = random_image(1)
    ours = engine.mm_processor.pixels(image, "image")
    assert torch.equal(ours, theirs(images=[image], return_tensors="pt")["pixel_values"][0])
    hf = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.inference_mode():  # the tower and projector themselves, not only the tokens
        want = hf.model.get_image_features(pixel_values=ours[None])
        want = getattr(want, "pooler_output", want)
        got = engine.runner.model.embed_images(ours[None])
    torch.testing.assert_close(got[0], torch.cat(list(want)), rtol=1e-5, atol=1e-5)
    one = image_prompt(engine, "what is this?", [random_image(1)])
    two = image_prompt(engine, "compare them", [random_image(2), random_image(3)])
    got = generate(engine, {"one": one, "two": two})
    assert len(one[0]) == 16 + len("what is this?")
    for rid, (ids, inputs) in {"one": one, "two": two}.items():
        assert got[rid] == hf_llava_greedy(llava, ids, [i.pixel_values for i in inputs]), rid
    assert got["one"] != got["two"]


def test_joined_folder_is_made_once_and_reused(files):
    _, text, mmproj = files
    first = resolve_model(str(text), str(mmproj))
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["vision_config"]["num_hidden_layers"] == 2  # the converter cut layer 3
    assert config["vision_feature_layer"] == 2
    stamp = (first / "config.json").stat().st_mtime_ns
    assert resolve_model(str(text), str(mmproj)) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp


def test_mmproj_of_another_projector_type_is_refused(files, tmp_path):
    llava, text, _ = files
    bad = tmp_path / "qwen.gguf"
    write_llava_mmproj(llava, bad, **{"clip.projector_type": "qwen2vl_merger"})
    with pytest.raises(ValueError, match=r"projector type 'qwen2vl_merger'.*supported: mlp"):
        resolve_model(str(text), str(bad))


def test_llava_next_tiles_and_missing_keys_are_refused(files, tmp_path):
    llava, text, _ = files
    tiled = tmp_path / "next.gguf"
    write_llava_mmproj(llava, tiled, **{"clip.vision.image_grid_pinpoints": [336, 672]})
    with pytest.raises(ValueError, match="LLaVA-NeXT's tiled images"):
        resolve_model(str(text), str(tiled))
    sizeless = tmp_path / "sizeless.gguf"
    write_llava_mmproj(llava, sizeless, **{"clip.vision.image_size": None})
    with pytest.raises(ValueError, match="clip.vision.image_size missing"):
        resolve_model(str(text), str(sizeless))


def test_mmproj_for_another_embedding_size_is_refused(files, tmp_path):
    llava, _, mmproj = files
    wide = _text_folder(llava, tmp_path / "wide-text")
    wcfg = json.loads((wide / "config.json").read_text())
    wcfg["hidden_size"] = 96  # a text model of another width
    (wide / "config.json").write_text(json.dumps(wcfg))
    from safetensors.numpy import load_file, save_file

    state = {
        n: torch.randn(*[96 if d == 64 else d for d in w.shape]).numpy()
        for n, w in load_file(str(wide / "model.safetensors")).items()
    }
    save_file(state, str(wide / "model.safetensors"), metadata={"format": "pt"})
    text = tmp_path / "wide.gguf"
    write_gguf(wide, text, "llama", "Wide", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match=r"64-wide embeddings.*hidden size is 96"):
        resolve_model(str(text), str(mmproj))


def test_non_vision_inputs_to_mmproj_are_refused(files, tmp_path, tiny_model_dir):
    llava, text, mmproj = files
    with pytest.raises(ValueError, match=r"architecture 'llama', not llama.cpp's 'clip'"):
        resolve_model(str(text), str(text))  # a text GGUF given as the mmproj
    with pytest.raises(ValueError, match="--mmproj goes with a .gguf text model"):
        resolve_model(str(tiny_model_dir), str(mmproj))
    plain = tmp_path / "plain.gguf"  # a text model without the <image> token
    write_gguf(_text_folder(llava, tmp_path / "plain-hf"), plain, "llama", "Plain")
    with pytest.raises(ValueError, match="has no <image> token"):
        resolve_model(str(plain), str(mmproj))
    audio = tmp_path / "audio.gguf"
    write_llava_mmproj(llava, audio, **{"clip.has_vision_encoder": False})
    with pytest.raises(ValueError, match="no vision encoder"):
        resolve_model(str(text), str(audio))
    with pytest.raises(ValueError, match="--mmproj file not found"):
        resolve_model(str(text), str(tmp_path / "missing.gguf"))


def test_server_with_mmproj_flag_answers_an_image_like_transformers(files):
    """`pagedserve serve text.gguf --mmproj mmproj.gguf` and the official openai client with a
    data: URL: the reply is transformers' greedy continuation of the same prompt and pixels."""
    from conftest import ServerProcess
    from openai import OpenAI
    from test_multimodal import MAX_NEW, data_url, png_bytes, url_part
    from transformers import AutoImageProcessor, AutoTokenizer

    llava, text, mmproj = files
    server = ServerProcess(
        str(text), "--mmproj", str(mmproj), "--dtype", "float32", "--served-model-name", "v"
    )
    try:
        client = OpenAI(base_url=server.wait_ready().url + "/v1", api_key="x")
        image = random_image(4)
        content = [url_part(data_url(png_bytes(image))), {"type": "text", "text": "and this?"}]
        reply = client.chat.completions.create(
            model="v",
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_NEW,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        cards = client.models.list().data
    finally:
        server.stop()
    tok = AutoTokenizer.from_pretrained(llava)
    chat = "<|im_start|>user\n<image>\nand this?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat)
    at = ids.index(tok.convert_tokens_to_ids(IMAGE_TOKEN))
    ids = ids[:at] + ids[at : at + 1] * 16 + ids[at + 1 :]
    pixels = AutoImageProcessor.from_pretrained(llava)(images=[image], return_tensors="pt")
    want = hf_llava_greedy(llava, ids, [pixels["pixel_values"][0]])
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert [c.id for c in cards] == ["v"]


def test_q8_text_gguf_plus_mmproj_matches_transformers_and_runs_packed(files, tmp_path):
    """The usual shipment: a quantized text GGUF beside the mmproj. float32 (dequantized text
    weights) equals transformers' LLaVA on the same dequantized weights; bf16 serves the text
    side's linears from the packed Q8_0 blocks."""
    import shutil

    import gguf
    from safetensors.numpy import load_file, save_file

    llava, _, mmproj = files
    text = tmp_path / "q8.gguf"
    write_gguf(
        _text_folder(llava, tmp_path / "q8-hf"),
        text,
        "llama",
        "Q8",
        gguf.GGMLQuantizationType.Q8_0,
        tokenizer=_tokenizer(),
    )
    joined = resolve_model(str(text), str(mmproj))
    assert (joined / "gguf_blocks.bin").is_file()
    ref = tmp_path / "ref"  # the LLaVA with the text side's dequantized weights
    shutil.copytree(llava, ref)
    state = {
        n: w
        for n, w in load_file(str(ref / "model.safetensors")).items()
        if "language_model" not in n
    }
    for name, weight in load_file(str(joined / "model.safetensors")).items():
        state["language_model." + name] = weight  # the classic layout transformers reads
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    engine = _engine(text, mmproj)
    prompt = image_prompt(engine, "q8", [random_image(6)])
    got = generate(engine, {"q": prompt})["q"]
    assert got == hf_llava_greedy(ref, prompt[0], [prompt[1][0].pixel_values])
    engine = _engine(text, mmproj, dtype="bfloat16")
    packed = [
        n
        for n, m in engine.runner.model.named_modules()
        if getattr(m, "quantization", None) == "gguf"
    ]
    assert len(packed) == 2 * 4 + 1  # qkv, o, gate_up, down per layer (fused), and the head
    assert len(generate(engine, {"b": image_prompt(engine, "q8", [random_image(6)])})["b"]) == 8
