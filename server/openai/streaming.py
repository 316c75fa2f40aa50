"""The one driver behind /v1/completions, /v1/chat/completions and /v1/responses.

`GenerationDriver` runs a request's choices (merged by `merge_outputs`, one engine stream per
choice), keeps each choice's `ChoiceState` (usage), and either gathers a whole body or writes
an SSE stream: the endpoint's opening frames, one frame per engine output that says anything,
its closing frames (the usage chunk, `response.completed`), and then `data: [DONE]`. An engine
failure before the response is chosen is raised as its error object; one after the SSE header
is out becomes an in-band error frame, then the stream ends as usual. Leaving the loop early
(client disconnect) closes the engine streams, which aborts their requests.

An endpoint subclasses it and says only what its pieces look like:

    collect(index, out)   non-streamed: take in one engine output
    chunk(index, out)     streamed: one output -> its SSE frame(s), or None
    opening(), closing()  streamed: frames before the first / after the last output
    response_body()       non-streamed: the JSON body
    error_frame(err)      streamed: an engine failure in-band (default: OpenAI's error object)

Completions and chat share `ChunkStreamDriver`'s chunk and closing (a formatter's delta in the
stream's envelope; the usage chunk). Responses fits the same loop: its typed events (`event:
<type>` lines) are what its `chunk` returns, `response.created` / `response.completed` its
opening and closing, an `error` event its error frame, and its stream has no `[DONE]` (`done =
None`), as OpenAI's has none.

Chunks are the hot path (one per token per stream): `ChunkEnvelope` renders a chunk's head (id,
object, created, model) once per stream, so each chunk costs one `model_dump_json` of its choice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from engine.outputs import RequestOutput
from server.openai.errors import APIError, engine_error, error_body
from server.openai.protocol import UsageInfo
from server.openai.serving import (
    ChoiceRequest,
    ChoiceState,
    ServingContext,
    make_usage,
    merge_outputs,
)

DONE = "data: [DONE]\n\n"


def sse(data: str) -> str:
    """One SSE frame holding `data` (a JSON text)."""
    return f"data: {data}\n\n"


def sse_event(kind: str, data: str) -> str:
    """One typed SSE frame (Responses): `event: <kind>` then its data."""
    return f"event: {kind}\ndata: {data}\n\n"


def error_frame(err: APIError) -> str:
    """An engine failure after the SSE header: OpenAI's error object as one data frame."""
    return sse(json.dumps(error_body(err.status, err.message, err.type)))


def chunk_envelope(head: BaseModel, exclude: set[str] | None = None) -> tuple[str, str]:
    """The JSON around the choice of a one-choice chunk of `head` (choices=[]): before +
    choice.model_dump_json() + after is head.model_copy(update={"choices": [choice]})
    .model_dump_json(exclude=exclude), with the head rendered once per stream instead of once
    per token."""
    envelope = head.model_dump_json(exclude=exclude)
    cut = envelope.rindex('"choices":[]') + len('"choices":[')
    return envelope[:cut], envelope[cut:]


class ChunkEnvelope:
    """One-choice SSE chunks of `head` (a chunk model with choices=[]), framing included."""

    __slots__ = ("before", "after")

    def __init__(self, head: BaseModel, exclude: set[str] | None = None) -> None:
        before, after = chunk_envelope(head, exclude)
        self.before, self.after = "data: " + before, after + "\n\n"

    def frame(self, choice: BaseModel) -> str:
        return self.before + choice.model_dump_json() + self.after


class GenerationDriver:
    """A request's choices run to one body or one SSE stream; subclasses supply the shapes."""

    done: str | None = DONE  # the stream's last frame (None: Responses ends with its event)

    def __init__(
        self, ctx: ServingContext, prompts: list[list[int]], choices: list[ChoiceRequest]
    ) -> None:
        self.ctx, self.prompts, self.choices = ctx, prompts, choices
        self.states = [ChoiceState() for _ in choices]

    # ---- what an endpoint supplies ---------------------------------------------------------
    def collect(self, index: int, out: RequestOutput) -> None:
        raise NotImplementedError

    def chunk(self, index: int, out: RequestOutput) -> str | None:
        raise NotImplementedError

    def response_body(self) -> dict:
        raise NotImplementedError

    def opening(self) -> Iterable[str]:
        return ()

    def closing(self) -> Iterable[str]:
        return ()

    def error_frame(self, err: APIError) -> str:
        return error_frame(err)

    # ---- the one loop ----------------------------------------------------------------------
    def usage(self) -> UsageInfo:
        return make_usage(self.prompts, self.choices, self.states)

    async def respond(self, stream: bool) -> JSONResponse | StreamingResponse:
        if stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream")
        return await self.full()

    async def full(self) -> JSONResponse:
        states, collect = self.states, self.collect
        try:
            async for batch in merge_outputs(self.ctx, self.choices):
                for index, out in batch:
                    states[index].add(out)
                    collect(index, out)
        except Exception as e:  # noqa: BLE001 - engine failures become an error object
            raise engine_error(e) from e
        return JSONResponse(self.response_body())

    async def stream(self) -> AsyncIterator[str]:
        states, chunk = self.states, self.chunk
        try:
            for frame in self.opening():
                yield frame
            async for batch in merge_outputs(self.ctx, self.choices):
                for index, out in batch:
                    states[index].add(out)
                    frame = chunk(index, out)
                    if frame is not None:
                        yield frame
            for frame in self.closing():
                yield frame
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band, then end
            yield self.error_frame(engine_error(e))
        if self.done is not None:
            yield self.done


class ChunkStreamDriver(GenerationDriver):
    """Completions and chat: each streamed output is its choice formatter's delta in the
    stream's `envelope`, and with include_usage the last chunk is `head` carrying the usage.
    A subclass sets `formatters` and `include_usage`, and `head` and `envelope` by `opening`."""

    formatters: list
    include_usage: bool
    head: BaseModel
    envelope: ChunkEnvelope

    def chunk(self, index: int, out: RequestOutput) -> str | None:
        d = self.formatters[index].delta(out)
        return None if d is None else self.envelope.frame(d)

    def closing(self) -> list[str]:
        if not self.include_usage:
            return []
        return [sse(self.head.model_copy(update={"usage": self.usage()}).model_dump_json())]
