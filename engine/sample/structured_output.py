"""Grammars for constrained decoding (llguidance): what a request asks for, compiled once.

    GrammarSpec (kind, text) --GrammarCompiler--> CompiledGrammar --.new_matcher()--> LLMatcher
        cached by (kind, text); compiled on a worker thread, refused after a time limit

A request's matcher (one per engine request, n > 1 gets n of them) follows its output tokens
only, never its KV: preemption by recompute re-runs the tokens through the model but not
through the matcher. Masks for a whole batch are filled and applied in
`engine/sample/grammar_mask.py`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from engine.sampling_params import GrammarError, GrammarSpec

# OpenAI's JSON is single-line with ", " and ": "; flexible whitespace lets a weak model loop on
# blanks forever. A schema's own "x-guidance" options override these.
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


class CompiledGrammar:
    """A compiled grammar and its first mask, ready to copy: each copy is one request's state."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._template = matcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (nothing compiled yet)."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_DEFAULTS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=_JSON_DEFAULTS
        )
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {e}") from e
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _describe_error(spec: GrammarSpec, error: str) -> str:
    """llguidance's message, with unsupported JSON-schema keywords named up front."""
    m = _UNIMPLEMENTED.search(error)
    if m is not None:
        names = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"unsupported JSON schema keyword: {names}"
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex"}
    return f"invalid {what.get(spec.kind, spec.kind)}: {error}"


class GrammarCompiler:
    """Compiles specs into matchers for one tokenizer, on worker threads, with a time limit.

    Every outcome is cached by spec, errors and timeouts included, so a pathological schema costs
    one compile however often it is sent (llguidance drops the GIL while it compiles, so neither
    the event loop nor the engine thread waits for it).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_workers: int = 2,
    ) -> None:
        import llguidance.hf  # imports transformers: only where a tokenizer exists anyway

        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[GrammarSpec, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking: compiles (or takes from the cache) on the caller's thread, no time limit."""
        hit = self._lookup(spec)
        if hit is None:
            hit = self._store(spec, self._build(spec))
        return _unwrap(hit)

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """On a worker thread; a compile that outlasts the time limit is refused from then on."""
        hit = self._lookup(spec)
        if hit is not None:
            return _unwrap(hit)
        future = self._submit(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            msg = f"the grammar took longer than {self.timeout_s:g} s to compile"
            self._store(spec, GrammarError(msg))
        return _unwrap(self._lookup(spec))

    def _submit(self, spec: GrammarSpec) -> Future:
        with self._lock:
            future = self._inflight.get(spec)
            if future is None:
                future = self._pool.submit(self._compile_and_store, spec)
                self._inflight[spec] = future
            return future

    def _compile_and_store(self, spec: GrammarSpec) -> None:
        try:
            self._store(spec, self._build(spec))
        finally:
            with self._lock:
                self._inflight.pop(spec, None)

    def _build(self, spec: GrammarSpec) -> CompiledGrammar | GrammarError:
        try:
            text = grammar_text(spec)
        except GrammarError as e:
            return e
        except ValueError as e:
            return GrammarError(_describe_error(spec, str(e)))
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if not matcher.is_error():  # the first mask builds the lexer states most requests reuse
            matcher.compute_bitmask()
        if matcher.is_error():
            return GrammarError(_describe_error(spec, matcher.get_error()))
        return CompiledGrammar(spec, matcher)

    def _lookup(self, spec: GrammarSpec) -> CompiledGrammar | GrammarError | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def _store(self, spec: GrammarSpec, outcome: CompiledGrammar | GrammarError):
        """The first outcome stays: a compile finishing after its timeout does not replace it."""
        with self._lock:
            kept = self._cache.setdefault(spec, outcome)
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return kept

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _unwrap(outcome: CompiledGrammar | GrammarError) -> CompiledGrammar:
    if isinstance(outcome, GrammarError):
        raise GrammarError(str(outcome), outcome.param)
    return outcome
