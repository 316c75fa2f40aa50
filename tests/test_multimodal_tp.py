"""Images under tensor parallelism (two gloo ranks on CPU, the mp executor): LLaVA and
Qwen2.5-VL give transformers' greedy float32 tokens. The pixels travel to every rank with the
request; each rank runs the (replicated) vision tower and its shard of the text model."""

from __future__ import annotations

import pytest
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


@pytest.fixture(autouse=True)
def _no_cached_hf_models():
    yield
    qwen._HF.clear()  # a later test's model dir may reuse a path


def test_other_image_models_are_refused_above_one_rank():
    from engine.llm_engine import _check_tp_images

    _check_tp_images("llava")
    _check_tp_images("qwen2_5_vl")
    with pytest.raises(ValueError, match="LLaVA and Qwen2.5-VL only yet, not gemma3"):
        _check_tp_images("gemma3")  # untested above one rank: refused at start-up
