"""Incremental detokenization with the byte-level tokenizer: every UTF-8 byte is its own token,
so emoji and CJK characters span several tokens and half characters must be held back."""

from __future__ import annotations

import pytest
from conftest import ScriptedSampler, build_byte_tokenizer, make_prompts, run_engine

from engine.output.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo 你好世界 😀👍🏽 ok",
    "🇺🇳 family: 👨‍👩‍👧‍👦, kanji 漢字, hangul 한국어",
    "ascii only",
    "ends in an emoji 🎉",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def _assert_clean(deltas: list[str]) -> None:
    for d in deltas:
        assert "\ufffd" not in d, deltas
        d.encode("utf-8", errors="strict")  # no lone surrogates either


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_every_delta_is_whole_characters(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: characters really are split
    prompt = tokenizer.encode("prompt: ")
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), ids, chunk)
    _assert_clean(deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert deltas[-1] == ""  # nothing was left over for the flush


def test_partial_character_is_held_until_complete(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    ids = tokenizer.encode("a😀")
    assert detok.step(ids[:1]) == "a"
    assert [detok.step([t]) for t in ids[1:4]] == ["", "", ""]  # 3 of the emoji's 4 bytes
    assert detok.step(ids[4:]) == "😀"


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ab😀")[:-1]  # generation stopped inside the emoji
    deltas = _stream(IncrementalDetokenizer(tokenizer, tokenizer.encode("p")), ids)
    assert "".join(deltas[:-1]) == "ab"
    assert "".join(deltas) == tokenizer.decode(ids)  # the flush gives what decode() gives


def test_no_prompt_text_in_the_first_delta(tokenizer):
    prompt = tokenizer.encode("a long prompt that ends inside a character 你")[:-1]
    ids = tokenizer.encode("Hi 好")
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert deltas[0] == "H"
    assert "".join(deltas) == "Hi 好"


def test_skip_special_tokens(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>")
    assert prompt[-1] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # in the context window
    ids = tokenizer.encode("Hey") + [tokenizer.eos_token_id]
    kept = _stream(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False), ids)
    skipped = _stream(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True), ids)
    assert "".join(kept) == "Hey<|im_end|>"
    assert "".join(skipped) == "Hey"
    assert kept[0] == skipped[0] == "H"  # the template's special tokens never leak either


def test_random_bytes_concatenate_to_decode(tokenizer):
    """Arbitrary byte soup (invalid sequences included) still adds up to decode(ids)."""
    prompt = make_prompts(1, seed=11)[0]
    for seed in range(5):
        ids = make_prompts(1, seed=100 + seed, min_len=40, max_len=80)[0]
        deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4))


def test_engine_streams_emoji_and_cjk(engine, tokenizer):
    """Scripted tokens through the real engine: deltas are whole characters, nothing leaks."""
    from engine.sampling_params import SamplingParams

    texts = {str(i): t for i, t in enumerate(TEXTS)}
    scripts = {rid: tokenizer.encode(t) for rid, t in texts.items()}
    prompt = tokenizer.encode("prompt ending inside 你")[:-1]
    saved, engine.runner.sampler = engine.runner.sampler, ScriptedSampler(scripts)
    try:
        params = {
            rid: (prompt, SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True))
            for rid, ids in scripts.items()
        }
        deltas = run_engine(engine, params)
    finally:
        engine.runner.sampler = saved
    for rid, outs in deltas.items():
        texts_out = [o.outputs[0].text for o in outs]
        _assert_clean(texts_out)
        assert "".join(texts_out) == texts[rid]
        assert [t for o in outs for t in o.outputs[0].token_ids] == scripts[rid]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_engine_random_output_text_equals_decode(engine, tokenizer):
    """Real sampling (arbitrary bytes): streamed text adds up to decode(token_ids)."""
    from engine.sampling_params import SamplingParams

    prompts = make_prompts(4, seed=21)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=24, ignore_eos=True)
    deltas = run_engine(engine, {f"q{i}": (p, params) for i, p in enumerate(prompts)})
    for outs in deltas.values():
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(
            ids, skip_special_tokens=True
        )
