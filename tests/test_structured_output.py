"""Grammar specs, compilation (errors, time limit, cache) and per-request matchers."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.sample.structured_output import GrammarCompiler
from engine.sampling_params import GrammarError, GrammarSpec
from tests.conftest import build_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture()
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer))
    yield c
    c.shutdown()


def run_tokens(tokenizer, matcher, text: str) -> bool:
    return matcher.consume_tokens(tokenizer.encode(text))


def slow_schema(num_branches: int = 6000) -> dict:
    """An anyOf of many one-key objects: valid, and slow for llguidance to compile."""
    return {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(num_branches)
        ]
    }


def test_equal_schemas_share_one_key():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    b = GrammarSpec.json_schema('{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert a == b and hash(a) == hash(b)


def test_json_schema_matcher_accepts_only_the_schema(tokenizer, compiler):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "y"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    ok = grammar.new_matcher()
    assert run_tokens(tokenizer, ok, '{"n": 12, "s": "y"}') and ok.is_accepting()
    bad = grammar.new_matcher()  # a fresh copy: the first one's state is its own
    assert not run_tokens(tokenizer, bad, '{"n": "12"')


def test_regex_choice_grammar_and_json_object(tokenizer, compiler):
    cases = [
        (GrammarSpec("regex", r"[a-c]{2}\d"), "ab7", "abc"),
        (GrammarSpec.choice(["yes", "no"]), "no", "maybe"),
        (GrammarSpec("grammar", 'start: "a" b\nb: "x" | "y"'), "ay", "az"),
        (GrammarSpec("grammar", 'root ::= "p" ("q" | "r")'), "pr", "pp"),  # GBNF
        (GrammarSpec("json_object"), '{"k": [1, 2]}', "[1]"),
    ]
    for spec, good, bad in cases:
        g = compiler.compile(spec)
        m = g.new_matcher()
        assert run_tokens(tokenizer, m, good) and m.is_accepting(), spec
        assert not run_tokens(tokenizer, g.new_matcher(), bad), spec


def test_unsupported_keyword_is_named(compiler):
    with pytest.raises(GrammarError, match="unsupported JSON schema keyword: not"):
        compiler.compile(GrammarSpec.json_schema({"type": "object", "not": {"type": "string"}}))


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "frobnicate"}),
        GrammarSpec.json_schema({"$ref": "#/$defs/missing"}),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("grammar", "start: undefined_rule"),
    ],
)
def test_invalid_grammars_are_grammar_errors(compiler, spec):
    with pytest.raises(GrammarError):
        compiler.compile(spec)


def test_schema_text_must_be_json():
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(GrammarError):
        GrammarSpec.choice([])


def test_cache_keeps_outcomes_errors_included(compiler):
    spec = GrammarSpec("regex", "[0-9]+")
    first = compiler.compile(spec)
    assert compiler.compile(spec) is first
    bad = GrammarSpec("regex", "(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(bad)
    assert compiler.num_cached == 2


def test_cache_is_bounded(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), cache_size=2)
    for i in range(4):
        c.compile(GrammarSpec("regex", f"a{{{i + 1}}}"))
    assert c.num_cached == 2
    c.shutdown()


def test_compile_async_times_out_and_stays_refused(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), timeout_s=0.05)
    spec = GrammarSpec.json_schema(slow_schema())

    async def go():
        with pytest.raises(GrammarError, match="longer than 0.05 s"):
            await c.compile_async(spec)
        # the worker thread finishing later does not turn the refusal into a grammar
        with pytest.raises(GrammarError, match="longer than"):
            await c.compile_async(spec)
        return await c.compile_async(GrammarSpec("regex", "x+"))

    assert asyncio.run(go()) is not None
    c.shutdown()


def test_compile_async_reuses_cache(compiler):
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "boolean"}})

    async def go():
        return await compiler.compile_async(spec), await compiler.compile_async(spec)

    a, b = asyncio.run(go())
    assert a is b


def test_matcher_rollback_and_eos(tokenizer, compiler):
    m = compiler.compile(GrammarSpec.choice(["ab"])).new_matcher()
    assert run_tokens(tokenizer, m, "a") and not m.is_accepting()
    assert m.rollback(1) and run_tokens(tokenizer, m, "ab") and m.is_accepting()
    assert m.consume_token(tokenizer.eos_token_id)
    assert json.loads(GrammarSpec.choice(["x"]).text) == ["x"]


def test_property_order_is_kept_other_keys_sorted(tokenizer, compiler):
    """strict outputs keep the schema's key order (OpenAI's); other keys do not split the cache."""
    a = GrammarSpec.json_schema({"type": "object", "properties": {"z": {}, "a": {}}})
    b = GrammarSpec.json_schema({"properties": {"z": {}, "a": {}}, "type": "object"})
    assert a == b and json.loads(a.text)["properties"] == {"z": {}, "a": {}}
    assert list(json.loads(a.text)["properties"]) == ["z", "a"]
