"""Gemma 3 vision (engine/models/gemma3_vl.py, gemma3_vl_attention.py): a tiny random-weight
Gemma3ForConditionalGeneration against transformers' generate on the same weights and pixels
(float32, greedy) — the SigLIP tower with post_layernorm, the pooled projector, the image
sequence of the folder's own processor, and transformers' bidirectional attention among an
image's tokens on a sliding and a global layer, through chunked prefill, prefix hits and
preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_byte_tokenizer, tiny_config

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SPECIALS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
MAX_NEW = 8
IMAGE_TOKENS = 16
WINDOW = 8  # shorter than an image: the sliding layer's mask is AND(window, causal OR image)


def build_tiny_gemma3_vl_dir(path, seed: int = 0):
    """2 SigLIP layers of 32 over 32x32 images in 4-pixel patches (an 8x8 grid pooled 2x2 to 16
    tokens), a Gemma 3 text side of 64 with a sliding (window 8) and a global layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    boi, image, eoi = tok.convert_tokens_to_ids(SPECIALS)
    text = tiny_config(tok, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
    text |= dict(layer_types=["sliding_attention", "full_attention"], model_type="gemma3_text")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, image_size=32)
    vision |= dict(num_attention_heads=4, patch_size=4, vision_use_head=False)
    vision |= dict(model_type="siglip_vision_model")
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # a visible image signal and norms that matter
        for name, p in model.named_parameters():
            if "vision_tower" in name and p.dim() > 1 or "mm_input_projection" in name:
                p.normal_(0, 0.3)
            elif "norm" in name and "vision_tower" not in name:
                p.normal_(0, 3.0)  # as tests/test_gemma.py: else every answer is one token
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_gemma3_vl_dir(tmp_path_factory.mktemp("tiny-gemma3-vl"))


def random_image(seed: int, size=(40, 56)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


_HF: dict = {}


def hf_greedy(model_dir, ids: list[int], inputs: list, max_new: int = MAX_NEW) -> list[int]:
    from transformers import Gemma3ForConditionalGeneration

    key = str(model_dir)
    if key not in _HF:
        _HF[key] = Gemma3ForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    model = _HF[key]
    input_ids = torch.tensor([ids])
    kw = {}
    if inputs:
        kw["pixel_values"] = torch.stack([i.pixel_values for i in inputs])
        kw["token_type_ids"] = (input_ids == model.config.image_token_id).long()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
            do_sample=False, eos_token_id=None, **kw,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def image_prompt(engine: LLMEngine, text: str, images, before: str = "hi") -> tuple:
    """`before`, one image sequence per image, then `text`: (ids, inputs)."""
    mm = engine.mm_processor
    ids = engine.tokenizer.encode(before + mm.image_token * len(images) + text)
    return mm.expand(ids, [mm.pixels(image, "image") for image in images])


def generate(engine: LLMEngine, prompts: dict, max_new: int = MAX_NEW) -> dict[str, list]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for rid, (ids, inputs) in prompts.items():
        engine.add(engine.make_request(rid, ids, params, inputs))
    tokens: dict[str, list] = {rid: [] for rid in prompts}
    engine.last_cached, engine.preemptions = {}, 0
    while engine.has_unfinished_requests():
        outs, stats = engine.step()
        engine.preemptions += stats.num_preemptions
        for out in outs:
            tokens[out.request_id] += out.outputs[0].token_ids
            engine.last_cached[out.request_id] = out.num_cached_tokens
    return tokens


def test_image_sequence_is_the_processors(gemma_dir):
    """The prompt holds Gemma3Processor's "\\n\\n<boi>" + 16 soft tokens + "<eoi>\\n\\n"."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    engine = make_engine(gemma_dir)
    ids, inputs = image_prompt(engine, "what?", [random_image(1)])
    tok = engine.tokenizer
    tok.boi_token, tok.image_token, tok.eoi_token = SPECIALS  # what Gemma3Processor reads
    tok.boi_token_id, tok.image_token_id = tok.convert_tokens_to_ids(SPECIALS[:2])
    proc = Gemma3Processor(
        Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tok,
        image_seq_length=IMAGE_TOKENS,
    )  # fmt: skip
    want = proc(text="hi<start_of_image>what?", images=[random_image(1)], return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    assert torch.equal(inputs[0].pixel_values, want["pixel_values"][0])
    assert inputs[0].length == IMAGE_TOKENS and inputs[0].whole


def test_one_two_images_and_text_match_transformers(gemma_dir):
    engine = make_engine(gemma_dir)
    prompts = {
        "one": image_prompt(engine, "what is this?", [random_image(1)]),
        "two": image_prompt(engine, "compare", [random_image(2, (48, 32)), random_image(3)]),
        "text": (engine.tokenizer.encode("plain text, no image at all"), []),
    }
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(gemma_dir, *prompt), rid
    assert engine.runner.mm.num_images_encoded == 3


def test_causal_image_attention_would_differ(gemma_dir, monkeypatch):
    """The bidirectional rows matter in this model: without them the tokens leave
    transformers' (so the parity tests above check the mask)."""
    from engine.models.gemma3_vl import Gemma3ForConditionalGeneration

    monkeypatch.setattr(Gemma3ForConditionalGeneration, "set_step_images", lambda self, s: None)
    engine = make_engine(gemma_dir)
    prompts = {
        "one": image_prompt(engine, "what is this?", [random_image(1)]),
        "two": image_prompt(engine, "compare", [random_image(2, (48, 32)), random_image(3)]),
    }
    got = generate(engine, prompts)
    assert any(got[rid] != hf_greedy(gemma_dir, *p) for rid, p in prompts.items())


def test_chunked_prefill_keeps_images_whole(gemma_dir):
    """A 20-token budget: every chunk that reaches an image stops before it, the image runs
    whole in the next step; tokens equal transformers'."""
    engine = make_engine(gemma_dir, max_num_batched_tokens=20, block_size=4)
    prompt = image_prompt(engine, "chunks", [random_image(9), random_image(8)], "a longer head")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.add(engine.make_request("c", *prompt[:1], params, prompt[1]))
    tokens, ends = [], []
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            tokens += out.outputs[0].token_ids
        req = engine.scheduler.requests.get("c")
        ends.append(req.num_computed_tokens if req else None)
    for image in prompt[1]:
        assert not any(image.start < e < image.start + image.length for e in ends if e), ends
    assert ends[0] == prompt[1][0].start  # stopped before the image, not inside it
    assert tokens == hf_greedy(gemma_dir, *prompt)
    with pytest.raises(ValueError, match="max-num-batched-tokens >= 16"):
        make_engine(gemma_dir, max_num_batched_tokens=12)


def test_prefix_hit_and_different_images(gemma_dir):
    """The same image again: a hit covering the image, no second encoder run; another image
    behind identical tokens: no hit, transformers' answer for that image."""
    engine = make_engine(gemma_dir, block_size=4)
    first = image_prompt(engine, "describe it", [random_image(5)])
    again = image_prompt(engine, "describe that", [random_image(5)])
    other = image_prompt(engine, "describe it", [random_image(6)])
    assert other[0] == first[0]
    got = generate(engine, {"a": first})
    got |= generate(engine, {"b": again})
    assert engine.last_cached["b"] >= first[1][0].start + IMAGE_TOKENS
    assert engine.runner.mm.num_images_encoded == 1
    got |= generate(engine, {"c": other})
    assert engine.last_cached["c"] <= first[1][0].start
    for rid, prompt in {"a": first, "b": again, "c": other}.items():
        assert got[rid] == hf_greedy(gemma_dir, *prompt), rid
    assert got["a"] != got["c"]


def test_prefix_hit_inside_an_image(gemma_dir):
    """A small pool: a text request evicts the tail of an image request's cached blocks, so the
    same image again hits up to a block inside the image; the rest of the image runs in one
    chunk, its queries reading the cached image keys too. transformers' tokens."""
    engine = make_engine(gemma_dir, block_size=4, num_gpu_blocks_override=24)
    first = image_prompt(engine, "describe it", [random_image(5)], "abc")
    generate(engine, {"a": first}, max_new=1)
    generate(engine, {"t": (list(range(40, 64)), [])}, max_new=1)
    again = image_prompt(engine, "describe that", [random_image(5)], "abc")
    got = generate(engine, {"b": again})
    image = again[1][0]
    assert image.start < engine.last_cached["b"] < image.start + image.length
    assert got["b"] == hf_greedy(gemma_dir, *again)


def test_preemption_recompute(gemma_dir):
    """Two image requests whose prompts fit the pool together and whose answers do not."""
    engine = make_engine(gemma_dir, block_size=4, num_gpu_blocks_override=28)
    prompts = {
        "p": image_prompt(engine, "first", [random_image(21)]),
        "q": image_prompt(engine, "second", [random_image(22, (32, 48))]),
    }
    got = generate(engine, prompts, max_new=24)
    assert engine.preemptions >= 1
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(gemma_dir, *prompt, max_new=24), rid


def test_bfloat16_against_transformers_bf16(gemma_dir):
    """bf16 (packed CPU linears in the tower, the kernels' RMSNorm in the projector): the image
    embedding within bf16 rounding of transformers' bf16, and the first tokens equal its bf16
    generate."""
    from transformers import Gemma3ForConditionalGeneration

    engine = make_engine(gemma_dir, dtype="bfloat16")
    ids, inputs = image_prompt(engine, "what is this?", [random_image(1)])
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma_dir, dtype=torch.bfloat16).eval()
    x, pixels = torch.tensor([ids]), inputs[0].pixel_values[None].bfloat16()
    with torch.inference_mode():
        want = hf.model.get_image_features(pixels).pooler_output[0].float()
        ours = engine.runner.model.embed_images(pixels)[0].float()
        assert (ours - want).abs().max() <= 0.02 * want.abs().max()
        ref = hf.generate(
            x, attention_mask=torch.ones_like(x), pixel_values=pixels, max_new_tokens=4,
            token_type_ids=(x == hf.config.image_token_id).long(), do_sample=False,
            eos_token_id=None,
        )  # fmt: skip
    assert generate(engine, {"b": (ids, inputs)})["b"][:4] == ref[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def gemma_server(gemma_dir):
    from conftest import serve_float32

    yield from serve_float32(gemma_dir, "tiny-gemma3-vl")


def test_openai_client_data_url(gemma_server, gemma_dir):
    """The official client sends a data: URL; the answer is transformers' token for token."""
    import base64
    import io

    from openai import OpenAI

    image = random_image(11)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = OpenAI(base_url=gemma_server.url + "/v1", api_key="x")
    resp = client.chat.completions.create(
        model="tiny-gemma3-vl",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is this?"},
        ]}],
        max_tokens=MAX_NEW, temperature=0.0, logprobs=True,
    )  # fmt: skip
    engine = make_engine(gemma_dir)
    mm = engine.mm_processor
    text = f"<|im_start|>user\n{mm.image_token}\nwhat is this?<|im_end|>\n<|im_start|>assistant\n"
    ids, inputs = mm.expand(engine.tokenizer.encode(text), [mm.pixels(image, "image")])
    assert resp.usage.prompt_tokens == len(ids) == len(engine.tokenizer.encode(text)) + 15
    want = hf_greedy(gemma_dir, ids, inputs)
    got = [t.token for t in resp.choices[0].logprobs.content]
    assert got == [engine.tokenizer.decode([t]) for t in want]
