"""Stop strings: matched across token boundaries and inside tokens, truncated exactly, held back
while they may be starting, so streamed deltas always add up to the final text."""

from __future__ import annotations

import pytest
from conftest import ScriptedSampler, make_prompts, run_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import Request, RequestStatus
from engine.output.processor import RequestState
from engine.output.stop_checker import StopChecker
from engine.sampling_params import SamplingParams


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop string that completes first (then the earliest start) cuts the text."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


def _stream(checker: StopChecker, chunks: list[str]) -> tuple[list[str], str | None]:
    deltas = []
    for chunk in chunks:
        delta, stop = checker.step(chunk)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas + [checker.flush()], None


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=12),
    include=st.booleans(),
)
def test_streamed_text_equals_reference(text, stops, cuts, include):
    deltas, stop = _stream(StopChecker(stops, include), _split(text, cuts))
    assert ("".join(deltas), stop) == _reference(text, stops, include)
    if not include:  # no delta ever shows a piece of text that ends up cut
        assert all(s not in "".join(deltas) for s in stops)


def test_held_back_until_it_cannot_be_a_stop():
    checker = StopChecker(["STOP"])
    assert checker.step("go ST") == ("go ", None)
    assert checker.step("O") == ("", None)
    assert checker.step("P!") == ("", "STOP")
    checker = StopChecker(["STOP"])
    assert checker.step("go ST") == ("go ", None)
    assert checker.step("OMP") == ("STOMP", None)  # released once it is no longer a prefix
    assert checker.step("ST") == ("", None)
    assert checker.flush() == "ST"  # finished for another reason: it was ordinary text


def test_not_before_min_tokens():
    checker = StopChecker(["ab"])
    assert checker.step("xab", can_stop=False) == ("xab", None)
    assert checker.step("ab", can_stop=True) == ("", "ab")


# ---- through RequestState: tokens that decode to several characters ------------------------------
class WordTokenizer:
    """Each token id decodes to a whole word piece, so a stop string can end inside a token."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


PIECES = ["<prompt>", "Hel", "lo wor", "ld! ", "Bye", " now"]


def _run_state(stop: list[str], include: bool = False, ids=(1, 2, 3, 4, 5)):
    params = SamplingParams(
        temperature=0.0, max_tokens=len(ids), stop=stop, include_stop_str_in_output=include
    )
    req = Request("r", [0], params)
    state = RequestState(WordTokenizer(PIECES), req)
    deltas = []
    for i, token_id in enumerate(ids):
        req.all_token_ids.append(token_id)
        if i == len(ids) - 1:
            req.status = RequestStatus.FINISHED_LENGTH
        delta, stop_str = state.process_tokens(req, [token_id])
        deltas.append(delta)
        if stop_str is not None:
            return deltas, stop_str
    return deltas, None


def test_stop_inside_a_token():
    deltas, stop = _run_state(["o w"])
    assert (deltas, stop) == (["Hel", "l"], "o w")
    deltas, stop = _run_state(["o w"], include=True)
    assert ("".join(deltas), stop) == ("Hello w", "o w")


def test_stop_across_tokens_and_held_text():
    deltas, stop = _run_state(["world! B"])
    assert (deltas, stop) == (["Hel", "lo ", "", ""], "world! B")  # "wor", "ld! " held back


def test_no_stop_flushes_everything():
    deltas, stop = _run_state(["now!"])
    assert stop is None and deltas[-1] == " now"  # held " now" released by the finish
    assert "".join(deltas) == "Hello world! Bye now"


# ---- through the engine (byte tokenizer: every byte is a token) ----------------------------------
SCRIPT_TEXT = "Hello world! 你好世界 Stop here. 😀 more text"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4))


def _scripted(engine, cases: dict[str, dict], text: str = SCRIPT_TEXT):
    """Runs each case's SamplingParams kwargs over the scripted text; returns per-step deltas."""
    ids = engine.tokenizer.encode(text)
    prompt = engine.tokenizer.encode("prompt")
    saved, engine.runner.sampler = engine.runner.sampler, ScriptedSampler(dict.fromkeys(cases, ids))
    try:
        requests = {
            rid: (prompt, SamplingParams(temperature=0.0, max_tokens=len(ids), **kw))
            for rid, kw in cases.items()
        }
        result = run_engine(engine, requests)
    finally:
        engine.runner.sampler = saved
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_blocks  # stopped requests gave their blocks back
    return result


def _text(outs) -> str:
    return "".join(o.outputs[0].text for o in outs)


def _ids(outs) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


def test_engine_stop_strings(engine):
    cases = {
        "across": {"stop": ["Stop"]},
        "cjk": {"stop": ["好世"]},
        "start": {"stop": ["He"]},
        "include": {"stop": ["Stop"], "include_stop_str_in_output": True},
        "several": {"stop": ["here", "world", "xyz"]},
        "emoji": {"stop": ["😀"]},
        "none": {"stop": ["Hello!"]},  # held back at "Hello", released at " "
        "min_tokens": {"stop": ["He", "xt"], "min_tokens": 5},
    }
    out = _scripted(engine, cases)
    expected = {
        "across": ("Hello world! 你好世界 ", "Stop"),
        "cjk": ("Hello world! 你", "好世"),
        "start": ("", "He"),
        "include": ("Hello world! 你好世界 Stop", "Stop"),
        "several": ("Hello ", "world"),
        "emoji": ("Hello world! 你好世界 Stop here. ", "😀"),
        "none": (SCRIPT_TEXT, None),
        "min_tokens": (SCRIPT_TEXT[:-2], "xt"),  # "He" completed before min_tokens
    }
    for rid, (text, stop) in expected.items():
        outs = out[rid]
        assert _text(outs) == text, rid
        last = outs[-1].outputs[0]
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert (last.finish_reason, last.stop_reason) == ("stop" if stop else "length", stop), rid
    # Generation ends on the token that completed the stop string (its id is kept).
    completed = len("Hello world! 你好世界 Stop".encode())
    assert len(_ids(out["across"])) == len(_ids(out["include"])) == completed
    assert _ids(out["start"]) == engine.tokenizer.encode("He")


def test_engine_stop_token_text_is_not_output(engine):
    bang = engine.tokenizer.encode("!")[0]
    out = _scripted(
        engine,
        {
            "plain": {"stop_token_ids": [bang]},
            "include": {"stop_token_ids": [bang], "include_stop_str_in_output": True},
        },
    )
    assert _text(out["plain"]) == "Hello world"
    assert _text(out["include"]) == "Hello world!"
    assert _ids(out["plain"])[-1] == bang
    assert out["plain"][-1].outputs[0].stop_reason == bang


def test_engine_real_model_stop_truncates_free_run(engine):
    prompt = make_prompts(1, seed=31)[0]
    free = run_engine(
        engine, {"free": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))}
    )["free"]
    text = _text(free)
    i = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[i : i + 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    outs = run_engine(engine, {"stopped": (prompt, params)})["stopped"]
    assert _text(outs) == text[: text.index(stop)]
    assert outs[-1].outputs[0].stop_reason == stop
    assert len(_ids(outs)) < 24


def test_engine_stop_string_finishes_through_the_scheduler(engine, monkeypatch):
    calls = []
    finish = engine.scheduler.finish_by_stop_string

    def spy(req, stop_str):
        calls.append((req.request_id, req.status))
        finish(req, stop_str)

    monkeypatch.setattr(engine.scheduler, "finish_by_stop_string", spy)
    # "last": the stop string completes on the final token, which also reaches max_tokens.
    out = _scripted(engine, {"mid": {"stop": ["Stop"]}, "last": {"stop": ["xt"]}})
    assert dict(calls) == {"mid": RequestStatus.RUNNING, "last": RequestStatus.FINISHED_LENGTH}
    for rid, stop in (("mid", "Stop"), ("last", "xt")):
        last = out[rid][-1].outputs[0]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop), rid
    assert not engine.scheduler.requests and not engine.scheduler.running  # _scripted: blocks free
