"""Images under tensor parallelism (two gloo ranks on CPU, the mp executor): LLaVA,
Qwen2.5-VL and Gemma 3 give transformers' greedy float32 tokens. The pixels travel to every
rank with the request; each rank runs the (replicated) vision tower and its shard of the text
model."""

from __future__ import annotations

import pytest
import test_gemma3_vision as gemma
import test_qwen2_5_vl as qwen
from conftest import tiny_config
from test_multimodal import (
    build_tiny_llava_dir,
    generate,
    hf_llava_greedy,
    image_prompt,
    make_engine,
    random_image,
)


def test_llava_at_two_ranks_matches_transformers(tmp_path):
    path = build_tiny_llava_dir(tmp_path / "llava")  # vocab 260: splits over two ranks
    # an 8-token budget splits each 16-token image over chunks (and steps)
    engine = make_engine(path, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4)
    try:
        assert engine.config.distributed_executor_backend == "mp"
        prompts = {
            "one": image_prompt(engine, "what is this?", [random_image(1)]),
            "two": image_prompt(engine, "compare them", [random_image(2), random_image(3)]),
            "text": (engine.tokenizer.encode("plain text, no image"), []),
        }
        got = generate(engine, prompts)
        for rid, (ids, inputs) in prompts.items():
            assert got[rid] == hf_llava_greedy(path, ids, [i.pixel_values for i in inputs]), rid
        again = generate(engine, {"again": prompts["one"]})  # its blocks are cached
        assert engine.last_cached["again"] > 0
        assert again["again"] == got["one"]
    finally:
        engine.shutdown()


def test_qwen2_5_vl_at_two_ranks_matches_transformers(tmp_path, monkeypatch):
    # the byte tokenizer and 4 vision specials make 263 ids: pad the vocabulary to 264
    monkeypatch.setattr(qwen, "tiny_config", lambda tok, **kw: tiny_config(tok, vocab_size=264))
    path = qwen.build_tiny_qwen2_5_vl_dir(tmp_path / "qwen")
    engine = qwen.make_engine(path, tensor_parallel_size=2)
    try:
        one = qwen.image_prompt(engine, "what is this?", [random_image(1)])
        two = qwen.image_prompt(
            engine, "compare", [random_image(2, (48, 32)), random_image(3)], " and "
        )
        got = qwen.generate(engine, {"one": one, "two": two})
        for rid, (ids, inputs) in {"one": one, "two": two}.items():
            assert got[rid] == qwen.hf_greedy(path, ids, inputs), rid
    finally:
        engine.shutdown()


def test_gemma3_vision_at_two_ranks_matches_transformers_and_one_rank(tmp_path):
    """Each rank recomputes its own heads' image query rows (bidirectional within an image)
    over its shard of the paged cache; 4 query heads and 2 KV heads split 2:1 per rank."""
    path = gemma.build_tiny_gemma3_vl_dir(tmp_path / "gemma3")  # vocab 262: two halves
    prompts = {}
    # 24-token steps: the 16-token images are never split, the two-image prompt takes steps
    engine = gemma.make_engine(
        path, tensor_parallel_size=2, max_num_batched_tokens=24, block_size=4
    )
    try:
        prompts = {
            "one": gemma.image_prompt(engine, "what is this?", [random_image(1)]),
            "two": gemma.image_prompt(engine, "compare", [random_image(2), random_image(3)]),
            "text": (engine.tokenizer.encode("plain text, no image"), []),
        }
        got = gemma.generate(engine, prompts)
        again = gemma.generate(engine, {"again": prompts["one"]})  # a prefix hit
        assert engine.last_cached["again"] > 0
        assert again["again"] == got["one"]
    finally:
        engine.shutdown()
    for rid, (ids, inputs) in prompts.items():
        assert got[rid] == gemma.hf_greedy(path, ids, inputs), rid
    single = gemma.make_engine(path, max_num_batched_tokens=24, block_size=4)
    assert gemma.generate(single, prompts) == got  # TP=1 gives the same tokens


@pytest.fixture(autouse=True)
def _no_cached_hf_models():
    yield
    qwen._HF.clear()  # a later test's model dir may reuse a path
    gemma._HF.clear()


def test_other_image_models_are_refused_above_one_rank():
    from engine.llm_engine import _check_tp_images

    for model_type in ("llava", "qwen2_5_vl", "gemma3"):
        _check_tp_images(model_type)
    with pytest.raises(ValueError, match="Gemma 3 only yet, not mllama"):
        _check_tp_images("mllama")  # no such model here: refused at start-up
