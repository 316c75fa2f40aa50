"""POST /v1/completions: prompts -> n engine requests each -> one body or an SSE stream.

Streamed and non-streamed bodies come from the same per-choice deltas, so their text is equal
by construction.
"""

from __future__ import annotations

import uuid

from engine.outputs import RequestOutput
from server.openai.errors import APIError
from server.openai.logprobs import CompletionLogprobsBuilder, merge_completion_logprobs
from server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


def tokenize_prompts(ctx: ServingContext, body: CompletionRequest) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one token-id list per prompt."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    prompts = []
    for p in prompt:
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p, str):
            prompts.append(ctx.tokenizer.encode(p, add_special_tokens=body.add_special_tokens))
        else:  # the engine's make_request checks the ids against the vocabulary
            prompts.append(list(p))
    if not all(prompts):
        raise APIError(400, "prompt must contain at least one token", param="prompt")
    return prompts


class CompletionChoiceFormatter:
    """Turns one choice's engine deltas into CompletionChoice deltas (echo on the first)."""

    def __init__(self, ctx: ServingContext, choice: ChoiceRequest, echo: str | None, body):
        self.index, self.prompt_ids, self.echo = choice.index, choice.prompt_ids, echo
        self.num_logprobs = body.logprobs
        self.builder = None
        if body.logprobs is not None:
            offset = len(echo or "")  # generated offsets start after the echoed prompt
            self.builder = CompletionLogprobsBuilder(ctx.token_strings, body.logprobs, offset)
        self.first, self.finished = True, False

    def delta(self, out: RequestOutput) -> CompletionChoice | None:
        if self.finished:  # nothing after a choice's finish_reason
            return None
        c = out.outputs[0]
        text, logprobs = c.text, None
        if self.builder is not None:
            logprobs = self.builder.build(c.token_ids, c.logprobs)
        if self.first and self.echo is not None:
            text = self.echo + text
            if self.builder is not None:
                prompt_lp = CompletionLogprobsBuilder(self.builder.strings, self.num_logprobs)
                echoed = prompt_lp.build(self.prompt_ids, out.prompt_logprobs)
                logprobs = merge_completion_logprobs(echoed, logprobs)
        first, self.first = self.first, False
        self.finished = c.finish_reason is not None
        if not (first or text or c.token_ids or self.finished):
            return None
        return CompletionChoice(
            index=self.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )


async def create_completion(ctx: ServingContext, body: CompletionRequest):
    ctx.check_model(body.model)
    params = to_sampling_params(body, defaults=ctx.generation_defaults)
    await compile_grammar(ctx, params, (body.grammar_source() or (None, None))[1])
    prompts = tokenize_prompts(ctx, body)
    request_id = f"cmpl-{current_request_id()}"
    # Engine ids stay unique even when a client reuses its X-Request-Id.
    base_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    choices = plan_choices(base_id, prompts, [params] * len(prompts))
    make_requests(ctx, choices, "prompt", body.model, body.cache_salt)
    echoes = _echo_texts(ctx, body, prompts)
    formatters = [CompletionChoiceFormatter(ctx, c, echoes[c.prompt_idx], body) for c in choices]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    driver = CompletionDriver(ctx, request_id, prompts, choices, formatters, include_usage)
    return await driver.respond(body.stream)


def _echo_texts(ctx: ServingContext, body: CompletionRequest, prompts: list[list[int]]):
    if not body.echo:
        return [None] * len(prompts)
    raw = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if raw and isinstance(raw[0], int):
        raw = [raw]
    return [p if isinstance(p, str) else ctx.tokenizer.decode(ids) for p, ids in zip(raw, prompts)]


class CompletionDriver(ChunkStreamDriver):
    """Completions' pieces: CompletionChoice deltas, streamed in the head's envelope or
    combined per choice into one CompletionResponse."""

    def __init__(self, ctx, request_id, prompts, choices, formatters, include_usage: bool):
        super().__init__(ctx, prompts, choices)
        self.formatters, self.include_usage = formatters, include_usage
        self.head = CompletionResponse(
            id=request_id, model=ctx.response_model(choices), choices=[]
        )
        self.deltas: list[list[CompletionChoice]] = [[] for _ in choices]
        self.envelope: ChunkEnvelope | None = None

    def collect(self, index: int, out: RequestOutput) -> None:
        d = self.formatters[index].delta(out)
        if d is not None:
            self.deltas[index].append(d)

    def opening(self) -> list[str]:
        self.envelope = ChunkEnvelope(self.head)  # one head, one created, per stream
        return []

    def response_body(self) -> dict:
        choices = [_combine(i, ds) for i, ds in enumerate(self.deltas)]
        head, usage = self.head, self.usage()
        return CompletionResponse(
            id=head.id, model=head.model, choices=choices, usage=usage
        ).model_dump()


def _combine(index: int, deltas: list[CompletionChoice]) -> CompletionChoice:
    """One choice from its stream deltas (so full and streamed text agree by construction)."""
    logprobs = None
    if deltas and deltas[0].logprobs is not None:
        logprobs = CompletionLogprobs()
        for d in deltas:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(d.logprobs, name))
    last = deltas[-1] if deltas else None
    return CompletionChoice(
        index=index,
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
        finish_reason=last.finish_reason if last else None,
        stop_reason=last.stop_reason if last else None,
    )
