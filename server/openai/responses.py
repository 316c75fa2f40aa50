"""POST /v1/responses: read as a chat request, answered as a Response or typed SSE.

    response.created -> response.in_progress
    -> per output item: response.output_item.added
         message:       response.content_part.added, response.output_text.delta..., .done,
                        response.content_part.done
         function_call: response.function_call_arguments.delta..., .done
       response.output_item.done
    -> response.completed (status "incomplete" with reason max_output_tokens at the limit)

Every refusal (an unknown `previous_response_id` too) happens before the stream. A completed
response is stored (`store`, default true) for `previous_response_id`, GET, DELETE and its input
items (server/openai/responses_store.py).
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParamsError
from server.openai.chat import ChatRun, prepare_chat
from server.openai.errors import APIError, error_body
from server.openai.responses_protocol import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    output_text_part,
    response_object,
    responses_usage,
)
from server.openai.responses_store import StoredResponse, with_ids
from server.openai.serving import ServingContext
from server.openai.streaming import GenerationDriver, sse_event
from server.request_id import current_request_id
from server.tools.base import StreamDelta
from server.tools.plan import ToolCallReader

_RESPONSES_PARAMS = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


async def create_response(ctx: ServingContext, body: ResponsesRequest):
    history = []
    if body.previous_response_id is not None:
        previous = ctx.responses.get(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    chat_body = _as_chat(body, history)
    try:
        run = await prepare_chat(ctx, chat_body, f"resp_{current_request_id()}")
    except APIError as e:  # name the Responses field, not the chat one it became
        e.param = _RESPONSES_PARAMS.get(e.param, e.param)
        raise
    return await ResponseWriter(ctx, body, run, history).respond(body.stream)


def _as_chat(body: ResponsesRequest, history: list[dict]):
    try:
        return body.to_chat_request(history)
    except SamplingParamsError as e:
        raise APIError(400, str(e), param=e.param) from e
    except ValidationError as e:  # an item the chat request cannot hold (a role, a part)
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"input: {where}: {first.get('msg', 'invalid')}", param="input") from e


class ResponseWriter(GenerationDriver):
    """One generation's text -> Response output items, whole or as typed events (no `[DONE]`)."""

    done = None

    def __init__(
        self, ctx: ServingContext, body: ResponsesRequest, run: ChatRun, history: list[dict]
    ) -> None:
        super().__init__(ctx, [run.prompt_ids], run.choices)
        self.body, self.run, self.history = body, run, history
        self.stored = body.store is not False and ctx.responses.max_size > 0
        self.reader = ToolCallReader(run.plan, ctx.tool_call_parser)
        self.state = self.states[0]  # the one choice (Responses has no n)
        self.items: list[dict] = []  # output items, in order; the open one is last
        self.open_kind: str | None = None  # "message" or "function_call"
        self.calls: dict[int, dict] = {}  # tool-call index -> its item
        self.sequence_number = 0
        self.created_at: int | None = None

    # ---- the driver's hooks ----------------------------------------------------------------
    def collect(self, index: int, out: RequestOutput) -> None:
        self._collect(out)

    def response_body(self) -> dict:
        return self._store(self._response("completed"))

    def opening(self) -> list[str]:
        start = self._response("in_progress")
        self.created_at = start["created_at"]
        created = self._event("response.created", response=start)
        return [_send(created), _send(self._event("response.in_progress", response=start))]

    def chunk(self, index: int, out: RequestOutput) -> str | None:
        return "".join([_send(event) for event in self._collect(out)]) or None

    def closing(self) -> list[str]:
        final = self._store(self._response("completed"))
        incomplete = final["status"] == "incomplete"
        kind = "response.incomplete" if incomplete else "response.completed"
        return [_send(self._event(kind, response=final))]

    def error_frame(self, err: APIError) -> str:
        body = error_body(err.status, err.message, err.type)["error"]
        return _send(self._event("error", code=body["code"], message=body["message"], param=None))

    def _collect(self, out: RequestOutput) -> list[dict]:
        """Takes in one engine output (its usage already counted); returns the events it makes."""
        events = self._apply(self.reader.feed(out.outputs[0].text))
        if out.finished:
            cut = out.outputs[0].finish_reason == "length"
            events += self._apply(self.reader.finish(cut))
            events += self._close_open()
        return events

    # ---- items and events ------------------------------------------------------------------
    def _apply(self, delta: StreamDelta) -> list[dict]:
        events = []
        if delta.content:
            if self.open_kind != "message":
                events += self._close_open() + self._open_message()
            item = self.items[-1]
            item["_text"] += delta.content
            events.append(self._text_event("response.output_text.delta", delta=delta.content))
        for tc in delta.tool_calls:
            if tc.name is not None:
                events += self._close_open() + self._open_call(tc.index, tc.id, tc.name)
            if tc.arguments:
                item = self.calls[tc.index]
                item["arguments"] += tc.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(self.items) - 1,
                        delta=tc.arguments,
                    )
                )
        return events

    def _open_message(self) -> list[dict]:
        item = message_item(new_item_id("msg"), "", status="in_progress")
        item["_text"] = ""
        self.items.append(item)
        self.open_kind = "message"
        return [
            self._item_event("response.output_item.added", item),
            self._text_event("response.content_part.added", part=output_text_part("")),
        ]

    def _open_call(self, index: int, call_id: str, name: str) -> list[dict]:
        item = function_call_item(new_item_id("fc"), call_id, name, "", status="in_progress")
        self.items.append(item)
        self.calls[index] = item
        self.open_kind = "function_call"
        return [self._item_event("response.output_item.added", item)]

    def _close_open(self) -> list[dict]:
        if self.open_kind is None:
            return []
        item, kind = self.items[-1], self.open_kind
        self.open_kind = None
        item["status"] = "completed"
        if kind == "message":
            text = item.pop("_text")
            item["content"] = [output_text_part(text)]
            return [
                self._text_event("response.output_text.done", text=text),
                self._text_event("response.content_part.done", part=output_text_part(text)),
                self._item_event("response.output_item.done", item),
            ]
        done = self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=len(self.items) - 1,
            name=item["name"],
            arguments=item["arguments"],
        )
        return [done, self._item_event("response.output_item.done", item)]

    def _store(self, final: dict) -> dict:
        if self.stored:
            items = with_ids(self.body.input_items())
            # its input items: the chain's earlier inputs and outputs, then its own input
            inputs = [*self.history, *items]
            conversation = [*inputs, *final["output"]]
            self.ctx.responses.put(final["id"], StoredResponse(final, inputs, conversation))
        return final

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _item_event(self, kind: str, item: dict) -> dict:
        public = {k: v for k, v in item.items() if not k.startswith("_")}  # a snapshot
        return self._event(kind, output_index=len(self.items) - 1, item=dict(public))

    def _text_event(self, kind: str, **fields) -> dict:
        item_id = self.items[-1]["id"]
        extra = {"logprobs": []} if kind.startswith("response.output_text") else {}
        index = len(self.items) - 1
        return self._event(
            kind, item_id=item_id, output_index=index, content_index=0, **extra, **fields
        )

    def _response(self, status: str) -> dict:
        finished = status == "completed"
        limited = finished and self.state.finish_reason == "length"
        usage = None
        if finished:
            prompt = len(self.run.prompt_ids)
            usage = responses_usage(prompt, self.state.num_tokens, self.state.num_cached_tokens)
        output = [{k: v for k, v in i.items() if not k.startswith("_")} for i in self.items]
        return response_object(
            self.body,
            self.run.request_id,
            self.ctx.model_name,
            self.created_at,
            "incomplete" if limited else status,
            output,
            usage,
            "max_output_tokens" if limited else None,
            self.stored,
        )


def _send(event: dict) -> str:
    return sse_event(event["type"], json.dumps(event, ensure_ascii=False))
