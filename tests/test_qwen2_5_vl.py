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


def build_tiny_qwen2_5_vl_dir(path, seed: int = 0):
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
