"""POST /v1/chat/completions: messages -> chat template -> n engine requests -> body or SSE.

With tools, each choice's text goes through a ToolCallReader (server/tools/plan.py): content
and tool calls, whole or streamed as OpenAI streams them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from engine.outputs import RequestOutput
from engine.sampling_params import GrammarSpec, SamplingParamsError
from server.openai.errors import APIError
from server.openai.images import (
    IMAGE_PART_TYPES,
    collect_image_refs,
    expand_prompt,
    load_images,
)
from server.openai.logprobs import chat_logprobs
from server.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from server.openai.serving import (
    ChoiceRequest,
    ServingContext,
    compile_grammar,
    make_requests,
    plan_choices,
    to_sampling_params,
)
from server.openai.streaming import ChunkEnvelope, ChunkStreamDriver
from server.request_id import current_request_id
from server.tools.base import StreamDelta
from server.tools.generic_prompt import generic_conversation
from server.tools.plan import ToolCallReader, ToolPlan, plan_tools, template_messages

_TEXT_PART_TYPES = ("text", "input_text")


def _message_dict(m: ChatMessage, image_token: str | None = None) -> dict:
    """Text parts are joined with newlines (like vLLM), each image part becoming the model's
    image token (server/openai/images.py); other modalities are refused."""
    content = m.content
    if isinstance(content, list):
        accepted = _TEXT_PART_TYPES + (IMAGE_PART_TYPES if image_token else ())
        bad = next((p.type for p in content if p.type not in accepted), None)
        if bad is not None:
            msg = f"content part type {bad!r} is not supported; accepted: {', '.join(accepted)}"
            raise APIError(400, msg, param="messages")
        content = "\n".join(
            image_token if p.type in IMAGE_PART_TYPES else p.text or "" for p in content
        )
    extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
    return {**extra, "role": m.role, "content": content or ""}


def render_chat_prompt(
    tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    tools: list[dict] | None = None,
    image_token: str | None = None,
    plan: ToolPlan | None = None,
) -> list[int]:
    """The model's chat template as text, then tokens (the template carries its own specials).

    `tools` reach the template as its `tools` variable; history tool-call arguments as objects.
    A template with no tool support (`plan.generic`) gets the tools in the system prompt and
    the tool history as text instead (server/tools/generic_prompt.py).
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        conversation = template_messages([_message_dict(m, image_token) for m in messages])
    except SamplingParamsError as e:
        raise APIError(400, str(e), param=e.param) from e
    if plan is not None and plan.generic:
        conversation = generic_conversation(
            conversation, plan.functions, plan.mode, plan.function_name, plan.parallel
        )
        tools = None
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # noqa: BLE001 - a template's raise_exception() is the user's error
        raise APIError(400, f"chat template error: {e}", param="messages") from e
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise APIError(400, "messages rendered to an empty prompt", param="messages")
    return ids


class ChatChoiceFormatter:
    """One choice's engine deltas -> chat stream choices; also accumulates the full message."""

    def __init__(self, ctx: ServingContext, choice: ChoiceRequest, body, plan: ToolPlan):
        self.index, self.strings = choice.index, ctx.token_strings
        self.num_top = (body.top_logprobs or 0) if body.logprobs else None
        self.reader = ToolCallReader(plan, ctx.tool_call_parser)
        self.content, self.logprobs = "", []
        self.tool_calls: dict[int, ToolCall] = {}
        self.finish_reason, self.stop_reason = None, None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self, out: RequestOutput) -> ChatStreamChoice | None:
        if self.finished:  # nothing after a choice's finish_reason
            return None
        c = out.outputs[0]
        read = self.reader.feed(c.text)
        if c.finish_reason is not None:
            tail = self.reader.finish(cut=c.finish_reason == "length")
            read = StreamDelta(read.content + tail.content, read.tool_calls + tail.tool_calls)
        self.content += read.content
        calls = self._add_calls(read)
        self.finish_reason = self.reader.finish_reason(c.finish_reason)
        self.stop_reason = c.stop_reason
        logprobs = None
        if self.num_top is not None and c.token_ids:
            entries = chat_logprobs(self.strings, c.logprobs or [], self.num_top)
            self.logprobs += entries
            logprobs = ChatChoiceLogprobs(content=entries)
        if not (read.content or calls or logprobs or self.finished):
            return None
        content = read.content if read.content or (logprobs and not calls) else None
        return ChatStreamChoice(
            index=self.index,
            delta=DeltaMessage(content=content, tool_calls=calls or None),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _add_calls(self, read: StreamDelta) -> list[DeltaToolCall]:
        """Accumulates the calls and returns them as OpenAI's stream pieces (a call's first
        piece carries id, type and name), one piece per call per chunk."""
        pieces: dict[int, DeltaToolCall] = {}
        for d in read.tool_calls:
            if d.name is not None:
                fn = FunctionCall(name=d.name, arguments="")
                self.tool_calls[d.index] = ToolCall(id=d.id, function=fn)
            self.tool_calls[d.index].function.arguments += d.arguments
            piece = pieces.get(d.index)
            if piece is None:
                fn = DeltaFunctionCall(name=d.name, arguments=d.arguments)
                kind = "function" if d.id else None
                pieces[d.index] = DeltaToolCall(index=d.index, id=d.id, type=kind, function=fn)
            else:
                piece.function.arguments += d.arguments
        return list(pieces.values())

    def message_choice(self) -> ChatChoice:
        logprobs = None
        if self.num_top is not None:
            logprobs = ChatChoiceLogprobs(content=self.logprobs)
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)] or None
        content = self.content if self.content or not calls else None
        return ChatChoice(
            index=self.index,
            message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ChatRun:
    """A chat request past every check: its engine requests and how to read their text."""

    request_id: str
    prompt_ids: list[int]
    choices: list[ChoiceRequest]
    plan: ToolPlan


def plan_chat_tools(
    ctx: ServingContext, body: ChatCompletionRequest, answer: GrammarSpec | None = None
) -> ToolPlan:
    try:
        auto = ctx.tool_call_parser is not None
        return plan_tools(
            body.tools, body.tool_choice, body.parallel_tool_calls, auto, answer,
            ctx.tool_call_format,
        )  # fmt: skip
    except SamplingParamsError as e:
        raise APIError(400, str(e), param=e.param) from e


def plan_chat_grammar(ctx: ServingContext, body: ChatCompletionRequest, params):
    """(tool plan, sampling params with the grammar that covers the output, the field that
    grammar came from): a tool grammar, the request's own, or one joining both."""
    source = body.grammar_source()
    param = source[1] if source else None
    # a response_format is the final answer's: it joins "auto" calls in one grammar, and a
    # forced call ("required", named) comes before the answer
    answer = source[0] if param == "response_format" else None
    plan = plan_chat_tools(ctx, body, answer)
    if plan.mode == "auto" and source is not None and answer is None:
        plan = replace(plan, grammar=None)  # structured_outputs cover the whole text: no calls
    if plan.grammar is not None:
        if source is not None and answer is None:
            msg = f"{param} cannot be combined with tool_choice {plan.mode!r}"
            raise APIError(400, msg, param=param)
        params = replace(params, structured_outputs=plan.grammar)
        param = "response_format" if answer is not None and plan.mode == "auto" else "tools"
    return plan, params, param


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest, request_id: str):
    """Every refusal for a chat request, before any response: model, tools, sampling fields,
    grammar (compiled here, off the engine thread), template, limits, queue."""
    ctx.check_model(body.model)
    params = to_sampling_params(body, defaults=ctx.generation_defaults)
    plan, params, param = plan_chat_grammar(ctx, body, params)
    for fn in plan.functions if plan.mode != "none" else []:  # each schema must compile
        fn_params = replace(params, structured_outputs=GrammarSpec.json_schema(fn["parameters"]))
        await compile_grammar(ctx, fn_params, "tools")
    await compile_grammar(ctx, params, param)
    tools = body.tools if plan.functions else None
    refs = collect_image_refs(body.messages)
    pixels = await load_images(ctx, refs) if refs else []
    image_token = ctx.engine.mm_processor.image_token if refs else None
    prompt_ids = render_chat_prompt(
        ctx.tokenizer, body.messages, body.add_generation_prompt, body.add_special_tokens, tools,
        image_token, plan,
    )  # fmt: skip
    mm_inputs = None
    if refs:
        prompt_ids, mm_inputs = expand_prompt(ctx, prompt_ids, pixels)
    # Engine ids stay unique even when a client reuses its X-Request-Id.
    choices = plan_choices(f"{request_id}-{uuid.uuid4().hex[:8]}", [prompt_ids], [params])
    for c in choices:
        c.mm_inputs = mm_inputs
    make_requests(ctx, choices, "messages", body.model, body.cache_salt)
    return ChatRun(request_id, prompt_ids, choices, plan)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest):
    run = await prepare_chat(ctx, body, f"chatcmpl-{current_request_id()}")
    formatters = [ChatChoiceFormatter(ctx, c, body, run.plan) for c in run.choices]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await ChatDriver(ctx, run, formatters, include_usage).respond(body.stream)


class ChatDriver(ChunkStreamDriver):
    """Chat's pieces: chunks of ChatStreamChoice deltas (the role first, `usage: null` in each
    with include_usage), or one ChatCompletionResponse of each choice's whole message."""

    def __init__(self, ctx: ServingContext, run: ChatRun, formatters, include_usage: bool):
        super().__init__(ctx, [run.prompt_ids], run.choices)
        self.request_id, self.formatters = run.request_id, formatters
        self.include_usage = include_usage
        self.head: ChatCompletionChunk | None = None
        self.envelope: ChunkEnvelope | None = None

    def collect(self, index: int, out: RequestOutput) -> None:
        self.formatters[index].delta(out)  # each formatter keeps its whole message

    def opening(self) -> list[str]:
        created = int(time.time())  # one id and one created per stream
        self.head = ChatCompletionChunk(
            id=self.request_id,
            created=created,
            model=self.ctx.response_model(self.choices),
            choices=[],
        )
        self.envelope = ChunkEnvelope(self.head, None if self.include_usage else {"usage"})
        # the role goes in each choice's first delta, and only there
        role = DeltaMessage(role="assistant", content="")
        return [
            self.envelope.frame(ChatStreamChoice(index=f.index, delta=role))
            for f in self.formatters
        ]

    def response_body(self) -> dict:
        resp = ChatCompletionResponse(
            id=self.request_id,
            model=self.ctx.response_model(self.choices),
            choices=[f.message_choice() for f in self.formatters],
            usage=self.usage(),
        )
        return resp.model_dump()
