"""Qwen2.5-VL (engine/models/qwen2_5_vl.py, M-RoPE in engine/layers/mrope.py and
engine/multimodal/mrope.py): a tiny random-weight Qwen2_5_VLForConditionalGeneration against
transformers' generate on the same weights and pixels (float32, greedy) — dynamic resolution,
window and full attention layers, the 2x2 merger, 3-D positions through chunked prefill, prefix
hits, preemption — and the openai client against a real server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_byte_tokenizer, tiny_config

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_NEW = 8


def build_tiny_qwen2_5_vl_dir(path, seed: int = 0, **top):
    """A random-weight Qwen2_5_VLForConditionalGeneration (float32): 3 vision blocks of 32 (the
    middle one full attention, the others in windows of 2x2 merged tokens), patches of 4 pixels,
    2x2 merging, a 2-layer Qwen2 text side of 64 with mrope_section [2, 3, 3]; the byte tokenizer
    with Qwen's vision specials and Qwen2-VL's image processor (8-pixel multiples)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    ids = dict(zip(SPECIALS, tok.convert_tokens_to_ids(SPECIALS)))
    text = tiny_config(tok)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"]["mrope_section"] = [2, 3, 3]
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4)
    vision |= dict(spatial_merge_size=2, temporal_patch_size=2, window_size=16)
    vision |= dict(out_hidden_size=64, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **top,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # a visible image signal: larger random tower weights
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
    )  # fmt: skip
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen2_5_vl_dir(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))


def random_image(seed: int, size=(40, 56)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


_HF: dict = {}


def hf_greedy(model_dir, ids: list[int], inputs: list) -> list[int]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    key = str(model_dir)
    if key not in _HF:
        _HF[key] = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    model = _HF[key]
    input_ids = torch.tensor([ids])
    kw = {}
    if inputs:
        kw["pixel_values"] = torch.cat([i.pixel_values for i in inputs])
        kw["image_grid_thw"] = torch.tensor([i.grid_thw for i in inputs])
        kw["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            **kw,
        )
    return out[0, len(ids) :].tolist()


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def image_prompt(engine: LLMEngine, text: str, images, between: str = "") -> tuple:
    """One placeholder per image in front of `text`, tokenized and expanded: (ids, inputs)."""
    mm = engine.mm_processor
    ids = engine.tokenizer.encode((mm.image_token + between) * len(images) + text)
    return mm.expand(ids, [mm.pixels(image, "image") for image in images])


def generate(engine: LLMEngine, prompts: dict) -> dict[str, list]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
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


def test_one_image_two_sizes_and_text_match_transformers(qwen_dir):
    engine = make_engine(qwen_dir)
    one = image_prompt(engine, "what is this?", [random_image(1)])
    two = image_prompt(engine, "compare", [random_image(2, (48, 32)), random_image(3)], " and ")
    text = (engine.tokenizer.encode("plain text, no image"), [])
    assert one[1][0].grid_thw == (1, 10, 14) and one[1][0].length == 35
    assert two[1][0].grid_thw == (1, 12, 8) and two[1][0].length == 24
    got = generate(engine, {"one": one, "two": two, "text": text})
    for rid, (ids, inputs) in {"one": one, "two": two, "text": text}.items():
        assert got[rid] == hf_greedy(qwen_dir, ids, inputs), rid
    assert engine.runner.mm.num_images_encoded == 3


def test_tied_embeddings_as_the_3b_checkpoint(tmp_path):
    """Qwen2.5-VL-3B ties lm_head to the embeddings at the top level of its config only."""
    model_dir = build_tiny_qwen2_5_vl_dir(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    engine = make_engine(model_dir)
    model = engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = image_prompt(engine, "tied", [random_image(7)])
    assert generate(engine, {"t": prompt})["t"] == hf_greedy(model_dir, *prompt)


def test_positions_equal_transformers_rope_index(qwen_dir):
    """engine/multimodal/mrope.py against transformers' get_rope_index for a prompt with two
    images of different grids, scheduled in chunks of 7 (chunks start inside images), then the
    decode position (index + rope delta)."""
    from types import SimpleNamespace

    from transformers import Qwen2_5_VLForConditionalGeneration

    from engine.multimodal.mrope import MRopePositions

    engine = make_engine(qwen_dir)
    ids, inputs = image_prompt(engine, "?", [random_image(2, (48, 32)), random_image(3)], " x ")
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32)
    input_ids = torch.tensor([ids])
    want, delta = hf.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == hf.config.image_token_id).int(),
        image_grid_thw=torch.tensor([i.grid_thw for i in inputs]),
    )
    want = want[:, 0].numpy()
    mrope = MRopePositions(spatial_merge=2)
    req = SimpleNamespace(mm_inputs=inputs)
    for start in range(0, len(ids), 7):
        n = min(7, len(ids) - start)
        step = SimpleNamespace(requests=[req], num_scheduled_tokens=[n])
        got = mrope.positions(step, np.arange(start, start + n))
        got = got if got.ndim == 2 else np.tile(got, (3, 1))
        assert (got == want[:, start : start + n]).all(), start
    decode = mrope.positions(SimpleNamespace(requests=[req], num_scheduled_tokens=[1]),
                             np.array([len(ids) + 4]))  # fmt: skip
    assert decode.shape == (1,) and decode[0] == len(ids) + 4 + int(delta)


def test_chunked_prefill_splits_an_image(qwen_dir):
    engine = make_engine(qwen_dir, max_num_batched_tokens=8, block_size=4)
    prompt = image_prompt(engine, "chunks", [random_image(9)])
    got = generate(engine, {"c": prompt})
    assert got["c"] == hf_greedy(qwen_dir, *prompt)
    assert engine.runner.mm.num_images_encoded == 1  # encoded once, sliced per chunk


def test_prefix_hit_and_different_images(qwen_dir):
    """The same image again: a prefix-cache hit past the image (the next chunk starts after it,
    its positions shifted) and no second encoder run; another image behind the same tokens:
    no hit, another answer."""
    engine = make_engine(qwen_dir, block_size=4)
    first = image_prompt(engine, "describe it", [random_image(5)])
    again = image_prompt(engine, "describe that", [random_image(5)])
    other = image_prompt(engine, "describe it", [random_image(6)])
    assert other[0] == first[0]
    got = generate(engine, {"a": first})
    got |= generate(engine, {"b": again})
    assert engine.last_cached["b"] >= 36  # vision_start and the 35 image tokens at least
    assert engine.runner.mm.num_images_encoded == 1
    got |= generate(engine, {"c": other})
    assert engine.last_cached["c"] == 0
    for rid, prompt in {"a": first, "b": again, "c": other}.items():
        assert got[rid] == hf_greedy(qwen_dir, *prompt), rid
    assert got["a"] != got["c"]


def test_preemption_recompute(qwen_dir):
    engine = make_engine(qwen_dir, block_size=4, num_gpu_blocks_override=20)
    prompts = {
        "p": image_prompt(engine, "first", [random_image(21)]),
        "q": image_prompt(engine, "second", [random_image(22, (32, 48))]),
    }
    got = generate(engine, prompts)
    assert engine.preemptions >= 1
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(qwen_dir, *prompt), rid


@pytest.fixture(scope="module")
def qwen_server(qwen_dir):
    from conftest import serve_float32

    yield from serve_float32(qwen_dir, "tiny-qwen-vl")


def test_openai_client_data_url(qwen_server, qwen_dir):
    import base64
    import io

    import httpx
    from openai import OpenAI

    image = random_image(11)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = OpenAI(base_url=qwen_server.url + "/v1", api_key="x")
    resp = client.chat.completions.create(
        model="tiny-qwen-vl",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is this?"},
        ]}],
        max_tokens=MAX_NEW, temperature=0.0, logprobs=True,
    )  # fmt: skip
    engine = make_engine(qwen_dir)
    text = f"<|im_start|>user\n{PLACEHOLDER}\nwhat is this?<|im_end|>\n<|im_start|>assistant\n"
    mm = engine.mm_processor
    ids, inputs = mm.expand(engine.tokenizer.encode(text), [mm.pixels(image, "image")])
    assert resp.usage.prompt_tokens == len(ids) == len(engine.tokenizer.encode(text)) + 34
    want = hf_greedy(qwen_dir, ids, inputs)
    got = [t.token for t in resp.choices[0].logprobs.content]
    assert got == [engine.tokenizer.decode([t]) for t in want]
    card = httpx.get(qwen_server.url + "/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]


def test_bfloat16_packed_linears_run_the_tower(qwen_dir):
    """bf16 on CPU packs every Linear (the tower's, the merger's, the patch embedding's): the
    image embedding stays within bf16 rounding of transformers' in bf16 (this tiny model's
    bf16 tokens drift from float32's at once, transformers' own included), and the first
    tokens equal transformers' bf16 generate."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    engine = make_engine(qwen_dir, dtype="bfloat16")
    ids, inputs = image_prompt(engine, "what is this?", [random_image(1)])
    image, grid = inputs[0].pixel_values.bfloat16(), torch.tensor([inputs[0].grid_thw])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = hf.model.get_image_features(image, grid).pooler_output[0].float()
        ours = engine.runner.model.encode_images([image], [inputs[0].grid_thw])[0].float()
        assert (ours - want).abs().max() <= 0.02 * want.abs().max()
        ref = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=image, image_grid_thw=grid, max_new_tokens=4, do_sample=False,
            mm_token_type_ids=(torch.tensor([ids]) == hf.config.image_token_id).int(),
            eos_token_id=None,
        )  # fmt: skip
    got = generate(engine, {"b": (ids, inputs)})["b"]
    assert got[:4] == ref[0, len(ids) :].tolist()


def test_encoder_budget_spreads_images_over_steps(qwen_dir):
    """max_num_encoder_input_tokens=30: the 24-token image is encoded in the first step, the
    chunk stops before the 35-token one (over what is left), which runs alone next step (larger
    than the whole budget: never starved); a second request's image waits a step too. Tokens
    still equal transformers'."""
    engine = make_engine(qwen_dir, max_num_encoder_input_tokens=30)
    two = image_prompt(engine, "compare", [random_image(2, (48, 32)), random_image(3)], " and ")
    one = image_prompt(engine, "look", [random_image(4, (32, 32))])  # 16 tokens
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for rid, (ids, inputs) in {"two": two, "one": one}.items():
        engine.add(engine.make_request(rid, ids, params, inputs))
    tokens: dict[str, list] = {"two": [], "one": []}
    encoded, computed = [], []
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            tokens[out.request_id] += out.outputs[0].token_ids
        encoded.append(engine.runner.mm.num_images_encoded)
        req = engine.scheduler.requests.get("two")
        computed.append(req.num_computed_tokens if req else None)
    assert encoded[:3] == [1, 2, 3]  # one image per step
    assert computed[0] == two[1][1].start  # the first chunk stopped before the second image
    assert tokens == {"two": hf_greedy(qwen_dir, *two), "one": hf_greedy(qwen_dir, *one)}
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens must be positive"):
        EngineConfig(device="cpu", max_num_encoder_input_tokens=0)
