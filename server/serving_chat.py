"""POST /v1/chat/completions: messages -> chat template -> n engine requests -> body or SSE."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import RequestOutput
from server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from server.request_id import current_request_id
from server.serving_engine import (
    ChoiceRequest,
    ChoiceState,
    ServingContext,
    make_requests,
    make_usage,
    merge_outputs,
    plan_choices,
    sse,
    to_sampling_params,
)
from server.serving_errors import APIError, engine_error, error_body
from server.serving_logprobs import chat_logprobs

_TEXT_PART_TYPES = ("text", "input_text")


def _message_dict(m: ChatMessage) -> dict:
    """Text parts are joined with newlines (like vLLM); other modalities are refused."""
    content = m.content
    if isinstance(content, list):
        bad = next((p.type for p in content if p.type not in _TEXT_PART_TYPES), None)
        if bad is not None:
            raise APIError(400, f"content part type {bad!r} is not supported", param="messages")
        content = "\n".join(p.text or "" for p in content)
    extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
    return {**extra, "role": m.role, "content": content or ""}


def render_chat_prompt(
    tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool
) -> list[int]:
    """The model's chat template as text, then tokens (the template carries its own specials)."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    conversation = [_message_dict(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - a template's raise_exception() is the user's error
        raise APIError(400, f"chat template error: {e}", param="messages") from e
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise APIError(400, "messages rendered to an empty prompt", param="messages")
    return ids


class ChatChoiceFormatter:
    """One choice's engine deltas -> chat stream choices; also accumulates the full message."""

    def __init__(self, ctx: ServingContext, choice: ChoiceRequest, body: ChatCompletionRequest):
        self.index, self.strings = choice.index, ctx.token_strings
        self.num_top = (body.top_logprobs or 0) if body.logprobs else None
        self.content, self.logprobs = "", []
        self.finish_reason, self.stop_reason = None, None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self, out: RequestOutput) -> ChatStreamChoice | None:
        if self.finished:  # nothing after a choice's finish_reason
            return None
        c = out.outputs[0]
        self.content += c.text
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        logprobs = None
        if self.num_top is not None and c.token_ids:
            entries = chat_logprobs(self.strings, c.logprobs or [], self.num_top)
            self.logprobs += entries
            logprobs = ChatChoiceLogprobs(content=entries)
        if not (c.text or logprobs or self.finished):
            return None
        return ChatStreamChoice(
            index=self.index,
            delta=DeltaMessage(content=c.text if c.text or logprobs else None),
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def message_choice(self) -> ChatChoice:
        logprobs = None
        if self.num_top is not None:
            logprobs = ChatChoiceLogprobs(content=self.logprobs)
        return ChatChoice(
            index=self.index,
            message=ChatResponseMessage(content=self.content),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest):
    ctx.check_model(body.model)
    params = to_sampling_params(body)
    prompt_ids = render_chat_prompt(
        ctx.tokenizer, body.messages, body.add_generation_prompt, body.add_special_tokens
    )
    request_id = f"chatcmpl-{current_request_id()}"
    # Engine ids stay unique even when a client reuses its X-Request-Id.
    choices = plan_choices(f"{request_id}-{uuid.uuid4().hex[:8]}", [prompt_ids], [params])
    make_requests(ctx, choices, "messages")
    formatters = [ChatChoiceFormatter(ctx, c, body) for c in choices]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(ctx, request_id, [prompt_ids], choices, formatters, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await _full(ctx, request_id, [prompt_ids], choices, formatters)


async def _full(ctx, request_id, prompts, choices, formatters) -> JSONResponse:
    states = [ChoiceState() for _ in choices]
    try:
        async for batch in merge_outputs(ctx, choices):
            for index, out in batch:
                states[index].add(out)
                formatters[index].delta(out)
    except Exception as e:  # noqa: BLE001 - engine failures become an error object
        raise engine_error(e) from e
    resp = ChatCompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[f.message_choice() for f in formatters],
        usage=make_usage(prompts, choices, states),
    )
    return JSONResponse(resp.model_dump())


async def _stream(
    ctx, request_id, prompts, choices, formatters, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())  # one id and one created per stream
    head = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[])

    def chunk(choices_, usage=None) -> str:
        data = head.model_copy(update={"choices": choices_, "usage": usage}).model_dump()
        if not include_usage:
            data.pop("usage")
        return sse(json.dumps(data, ensure_ascii=False))

    states = [ChoiceState() for _ in choices]
    try:
        for f in formatters:  # the role goes in each choice's first delta, and only there
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=f.index, delta=role)])
        async for batch in merge_outputs(ctx, choices):
            for index, out in batch:
                states[index].add(out)
                d = formatters[index].delta(out)
                if d is not None:
                    yield chunk([d])
        if include_usage:
            yield chunk([], make_usage(prompts, choices, states))
    except Exception as e:  # noqa: BLE001 - headers are out: report in-band, then end
        err = engine_error(e)
        yield sse(json.dumps(error_body(err.status, err.message, err.type)))
    yield "data: [DONE]\n\n"
