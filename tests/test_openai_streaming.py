"""The generation driver (server/openai/streaming.py) on its own: loop, framing, errors, [DONE]."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from server.openai.errors import APIError
from server.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from server.openai.serving import ChoiceRequest
from server.openai.streaming import DONE, ChunkEnvelope, GenerationDriver, sse


class FakeEngine:
    """generate(request) yields request.texts one output each; raises `fail` after `fail_after`."""

    def __init__(self, fail: Exception | None = None, fail_after: int = 0) -> None:
        self.fail, self.fail_after = fail, fail_after
        self.closed: list[str] = []

    async def generate(self, request):
        try:
            for i, text in enumerate(request.texts):
                if self.fail is not None and i == self.fail_after:
                    raise self.fail
                last = i == len(request.texts) - 1
                out = CompletionOutput(0, text, [i], "stop" if last else None)
                yield RequestOutput(request.request_id, [1, 2], [out], last, 1)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.request_id)


def make_choices(texts: list[list[str]]) -> list[ChoiceRequest]:
    return [
        ChoiceRequest(i, 0, f"r-{i}", [1, 2], None, SimpleNamespace(request_id=f"r-{i}", texts=t))
        for i, t in enumerate(texts)
    ]


class EchoDriver(GenerationDriver):
    """Each output's text as a data frame; the body is each choice's whole text and usage."""

    def __init__(self, engine, texts) -> None:
        super().__init__(SimpleNamespace(engine=engine), [[1, 2]], make_choices(texts))
        self.texts = ["" for _ in texts]

    def collect(self, index, out) -> None:
        self.texts[index] += out.outputs[0].text

    def chunk(self, index, out):
        text = out.outputs[0].text
        return sse(json.dumps({"index": index, "text": text})) if text else None

    def opening(self):
        return [sse('"open"')]

    def closing(self):
        return [sse(self.usage().model_dump_json())]

    def response_body(self) -> dict:
        return {"texts": self.texts, "usage": self.usage().model_dump()}


def run_stream(driver: GenerationDriver) -> list[str]:
    async def drain():
        resp = await driver.respond(stream=True)
        return [frame async for frame in resp.body_iterator]

    return asyncio.run(drain())


def data(frames: list[str]) -> list:
    return [json.loads(f.removeprefix("data: ")) for f in frames if f != DONE]


def test_stream_opening_chunks_closing_then_done():
    frames = run_stream(EchoDriver(FakeEngine(), [["a", "", "b"]]))
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames)
    assert frames[-1] == DONE
    events = data(frames)
    assert events[0] == "open"
    assert events[1:3] == [{"index": 0, "text": "a"}, {"index": 0, "text": "b"}]  # "" skipped
    assert (
        events[3]
        == UsageInfo(
            prompt_tokens=2,
            completion_tokens=3,
            total_tokens=5,
            prompt_tokens_details={"cached_tokens": 1},
        ).model_dump()
    )


def test_stream_merges_choices_and_counts_each():
    driver = EchoDriver(FakeEngine(), [["a", "b"], ["c", "d", "e"]])
    events = data(run_stream(driver))
    by_choice = {0: "", 1: ""}
    for e in events[1:-1]:
        by_choice[e["index"]] += e["text"]
    assert by_choice == {0: "ab", 1: "cde"}
    assert [s.num_tokens for s in driver.states] == [2, 3]
    assert events[-1]["completion_tokens"] == 5 and events[-1]["prompt_tokens"] == 2


@pytest.mark.parametrize("n", [1, 2])
def test_engine_failure_mid_stream_is_one_error_frame_then_done(n):
    from engine.async_engine import EngineDeadError

    engine = FakeEngine(EngineDeadError("the engine is not running"), fail_after=1)
    frames = run_stream(EchoDriver(engine, [["a", "b", "c"]] * n))
    assert frames[-1] == DONE
    error = data(frames)[-1]
    assert error["error"]["type"] == "ServiceUnavailableError"
    assert error["error"]["message"] == "the engine is not running"
    assert not any("completion_tokens" in str(e) for e in data(frames))  # no usage after it
    assert sorted(engine.closed) == [f"r-{i}" for i in range(n)]  # every stream closed


def test_no_done_frame_when_the_endpoint_has_none():
    class Typed(EchoDriver):
        done = None

    frames = run_stream(Typed(FakeEngine(), [["a"]]))
    assert DONE not in frames and data(frames)[-1]["total_tokens"] == 3


def test_full_body_and_engine_errors_before_the_body():
    from engine.async_engine import QueueFullError

    resp = asyncio.run(EchoDriver(FakeEngine(), [["a", "b"], ["c"]]).respond(stream=False))
    body = json.loads(resp.body)
    assert body["texts"] == ["ab", "c"] and body["usage"]["total_tokens"] == 5
    failing = EchoDriver(FakeEngine(QueueFullError("full"), fail_after=1), [["a", "b"]])
    with pytest.raises(APIError) as e:
        asyncio.run(failing.respond(stream=False))
    assert e.value.status == 503


def test_leaving_the_stream_early_closes_the_engine_streams():
    engine = FakeEngine()
    driver = EchoDriver(engine, [["a", "b", "c"], ["d", "e", "f"]])

    async def first_two():
        stream = driver.stream()
        frames = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()  # what a client disconnect does to the response's iterator
        return frames

    assert len(asyncio.run(first_two())) == 2
    assert sorted(engine.closed) == ["r-0", "r-1"]


TOOL_DELTA = DeltaMessage(
    tool_calls=[
        DeltaToolCall(index=0, id="call-1", type="function", function=DeltaFunctionCall(name="f"))
    ]
)
LOGPROBS = ChatChoiceLogprobs(
    content=[
        ChatTokenLogprob(token="h\u00e9", logprob=-1e-7, bytes=[104, 195, 169], top_logprobs=[])
    ]
)


@pytest.mark.parametrize(
    "choice",
    [
        ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content="")),
        ChatStreamChoice(index=1, delta=DeltaMessage(content='h\u00e9llo "x"\n\U0001f389')),
        ChatStreamChoice(index=0, delta=TOOL_DELTA, finish_reason="tool_calls"),
        ChatStreamChoice(index=0, delta=DeltaMessage(content="h\u00e9"), logprobs=LOGPROBS),
        ChatStreamChoice(index=2, delta=DeltaMessage(), finish_reason="stop", stop_reason="</s>"),
    ],
)
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunk_envelope_is_the_chunks_json(choice, include_usage):
    """A chat chunk from the envelope: the chunk model's own JSON, `usage` (null) present only
    with include_usage, and the same content the per-chunk json.dumps rendering gave."""
    head = ChatCompletionChunk(id="chatcmpl-1", created=7, model='m\u00e9"q', choices=[])
    exclude = None if include_usage else {"usage"}
    frame = ChunkEnvelope(head, exclude).frame(choice)
    whole = head.model_copy(update={"choices": [choice]})
    assert frame == "data: " + whole.model_dump_json(exclude=exclude) + "\n\n"
    fields = head.model_dump(exclude={"choices", "usage"})
    old = {**fields, "choices": [choice.model_dump()]}
    if include_usage:
        old["usage"] = None
    assert json.loads(frame[6:]) == json.loads(json.dumps(old, ensure_ascii=False))
