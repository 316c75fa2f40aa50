"""What both OpenAI endpoints share: fan-out of n choices into engine requests, merging.

Every refusal happens in `make_requests` (the engine's one validation, then the queue bound),
before a response (or an SSE header) exists.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from engine.async_engine import AsyncEngine
from engine.core.request import Request
from engine.outputs import RequestOutput
from engine.sampling_params import GrammarError, SamplingParams, SamplingParamsError
from server.openai.errors import APIError, engine_error
from server.openai.logprobs import TokenStrings
from server.openai.protocol import PromptTokensDetails, UsageInfo
from server.openai.responses_store import ResponseStore

_INT64_MAX = 2**63 - 1
_DONE = object()


@dataclass
class ServingContext:
    engine: AsyncEngine  # only its facade: model_name, tokenizer, make_request, generate, ...
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    token_strings: TokenStrings
    # generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty: what a
    # request that leaves one unset gets (vLLM's --generation-config auto)
    generation_defaults: dict = field(default_factory=dict)
    # --enable-auto-tool-choice / --tool-call-parser (None: "auto" tool choice is refused)
    tool_call_parser: str | None = None
    # the call format read from the chat template ("generic": it has no tool support), whether
    # "auto" is on or off; forced calls use it too
    tool_call_format: str | None = None
    # stored /v1/responses (--responses-store-size)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(1000))

    @classmethod
    def build(cls, engine: AsyncEngine) -> ServingContext:
        tokenizer = engine.tokenizer
        return cls(
            engine=engine,
            tokenizer=tokenizer,
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            token_strings=TokenStrings(tokenizer),
            generation_defaults=dict(engine.generation_defaults),
        )

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            if self.lora_name_for(requested) is None:
                adapters = getattr(self.engine, "lora_adapters", ())
                served = ", ".join(f"`{n}`" for n in [self.model_name, *(a.name for a in adapters)])
                msg = f"The model `{requested}` does not exist. Served models: {served}."
                raise APIError(404, msg, "NotFoundError", "model", "model_not_found")

    def response_model(self, choices: list[ChoiceRequest]) -> str:
        """The `model` a response names: the LoRA adapter its requests ran under, as vLLM."""
        req = choices[0].request if choices else None
        lora = req.lora_request if req is not None else None
        return lora.name if lora is not None else self.model_name

    def lora_name_for(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model."""
        if requested is None or requested == self.model_name:
            return None
        names = {lora.name for lora in getattr(self.engine, "lora_adapters", ())}
        return requested if requested in names else None

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """For /detokenize; generation requests are checked by the engine's make_request."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            msg = f"token id {bad} is out of the vocabulary (size {self.vocab_size})"
            raise APIError(400, msg, param=param)


def to_sampling_params(
    body, param_fallback: str | None = None, defaults: dict | None = None
) -> SamplingParams:
    """body.to_sampling_params(defaults) with field errors turned into 400s naming the field."""
    try:
        return body.to_sampling_params(defaults)
    except SamplingParamsError as e:
        raise APIError(400, str(e), param=e.param) from e
    except ValueError as e:
        raise APIError(400, str(e), param=param_fallback) from e


async def compile_grammar(ctx: ServingContext, params: SamplingParams, param: str | None) -> None:
    """The request's grammar compiled (or found in the cache) before any engine request exists;
    400 naming `param` for one that is invalid, unsupported or too slow to compile."""
    if params.structured_outputs is None:
        return
    try:
        await ctx.engine.compile_grammar(params.structured_outputs)
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from e


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples: its own seed (seed + i, wrapped to int64) so choices differ.
    Beam search keeps n (the width): its first choice runs the search for all n."""
    if params.use_beam_search:
        return params
    seed = params.seed
    if seed is not None and i:
        seed = seed + i
        if seed > _INT64_MAX:
            seed -= 2**64
    return replace(params, n=1, seed=seed)


@dataclass
class ChoiceRequest:
    index: int  # choice index = prompt_idx * n + i
    prompt_idx: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    request: Request | None = None  # the engine's, built once by make_requests
    mm_inputs: list | None = None  # the prompt's images (server/openai/images.py)


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streamed bodies and usage)."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def plan_choices(
    base_id: str, prompts: list[list[int]], params: list[SamplingParams]
) -> list[ChoiceRequest]:
    n = params[0].n
    return [
        ChoiceRequest(p * n + i, p, f"{base_id}-{p * n + i}", ids, child_params(params[p], i))
        for p, ids in enumerate(prompts)
        for i in range(n)
    ]


def make_requests(
    ctx: ServingContext, choices: list[ChoiceRequest], prompt_param: str, model: str | None = None,
    cache_salt: str | None = None,
) -> None:
    """Every refusal (400 / 503), once per choice, before any output: the engine's Requests.

    The engine names prompt problems (vocabulary, context length) "prompt"; the endpoint's
    field for them is `prompt_param` ("messages" for chat). `model` (the body's) picks a LoRA
    adapter when it names one; `cache_salt` (the body's) keeps the prefix cache per tenant.
    """
    lora = ctx.lora_name_for(model)
    for c in choices:
        if c.params.use_beam_search and c.index % c.params.n:
            continue  # the prompt's first choice carries every beam (engine/core/beam_search.py)
        try:
            kwargs = {"mm_inputs": c.mm_inputs} if c.mm_inputs else {}
            if lora is not None:
                kwargs["lora_name"] = lora
            if cache_salt is not None:
                kwargs["cache_salt"] = cache_salt
            c.request = ctx.engine.make_request(c.request_id, c.prompt_ids, c.params, **kwargs)
        except Exception as e:  # noqa: BLE001 - mapped to 400 / 503 by engine_error
            err = engine_error(e)
            if err.param == "prompt":
                err.param = prompt_param
            raise err from e
    link_forks(choices)
    try:
        ctx.engine.check_queue(len(choices))
    except Exception as e:  # noqa: BLE001
        raise engine_error(e) from e


def link_forks(choices: list[ChoiceRequest]) -> None:
    """n > 1: every choice of a prompt forks from its first (engine/core/forks.py)."""
    first: dict[int, Request] = {}
    for c in choices:
        if c.request is None or c.params.use_beam_search:
            continue
        parent = first.setdefault(c.prompt_idx, c.request)
        if parent is not c.request:
            c.request.fork_parent_id = parent.request_id


async def merge_outputs(
    ctx: ServingContext, choices: list[ChoiceRequest]
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Runs every choice's engine stream; yields what is ready, in choice-index order.

    Leaving early (client disconnect) cancels the pumps, or closes the one choice's stream,
    which aborts the engine requests.
    """
    runs = [c for c in choices if c.request is not None]  # beam search: one per prompt
    if len(runs) == 1:  # the common case: no pump task, no queue between it and the response
        index = runs[0].index
        async with contextlib.aclosing(ctx.engine.generate(runs[0].request)) as stream:
            async for out in stream:
                yield _per_choice(index, out)
        return
    async for outputs in _merge_many(ctx, runs):
        yield [pair for index, out in outputs for pair in _per_choice(index, out)]


def _per_choice(index: int, out: RequestOutput) -> list[tuple[int, RequestOutput]]:
    """A beam search result holds its n sequences, best first: choices index .. index + n - 1."""
    if len(out.outputs) == 1:
        return [(index, out)]
    return [(index + i, replace(out, outputs=[c])) for i, c in enumerate(out.outputs)]


async def _merge_many(
    ctx: ServingContext, choices: list[ChoiceRequest]
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """n > 1: one pump task per choice into a queue; each batch is what the queue holds."""
    ready: asyncio.Queue = asyncio.Queue()

    async def pump(choice: ChoiceRequest) -> None:
        try:
            stream = ctx.engine.generate(choice.request)
            async for out in stream:
                ready.put_nowait((choice.index, out))
        except Exception as e:  # noqa: BLE001 - the consumer re-raises it in the request task
            ready.put_nowait((choice.index, e))
        ready.put_nowait((choice.index, _DONE))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    num_open = len(tasks)
    try:
        while num_open:
            batch = [await ready.get()]
            while not ready.empty():
                batch.append(ready.get_nowait())
            outputs, num_done = _sorted_outputs(batch)
            num_open -= num_done
            if outputs:
                yield outputs
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sorted_outputs(batch: list) -> tuple[list[tuple[int, RequestOutput]], int]:
    """The outputs of a batch in choice-index order and how many streams ended; re-raises a
    stream's exception."""
    outputs, num_done = [], 0
    for index, item in batch:
        if item is _DONE:
            num_done += 1
        elif isinstance(item, Exception):
            raise item
        else:
            outputs.append((index, item))
    outputs.sort(key=lambda x: x[0])
    return outputs, num_done


def make_usage(
    prompts: list[list[int]], choices: list[ChoiceRequest], states: list[ChoiceState]
) -> UsageInfo:
    """Each prompt counts once however many choices share it; cached from its first choice."""
    num_prompt = sum(len(p) for p in prompts)
    num_completion = sum(s.num_tokens for s in states)
    first = {}
    for c in choices:
        first.setdefault(c.prompt_idx, states[c.index].num_cached_tokens)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(first.values())),
    )
