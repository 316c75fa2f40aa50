"""POST /v1/completions/render and /v1/chat/completions/render in vLLM's shapes.

A router that tokenizes for precise prefix-cache scoring (llm-d) posts the body it would send
to /v1/completions or /v1/chat/completions and gets back what the engine would run, without
running it: vLLM's GenerateRequest (request_id, token_ids, sampling_params, model, stream,
cache_salt, priority, ...); chat answers one, completions a list with one per prompt. The
token ids are /tokenize's for the same prompt or messages (tests/test_render.py). Every
refusal the generation endpoint would give (model, fields, context length) is given here too.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict

from engine.sampling_params import SamplingParams
from server.openai.chat import plan_chat_grammar, render_chat_prompt
from server.openai.completions import tokenize_prompts
from server.openai.errors import engine_error
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.serving import ServingContext, compile_grammar, to_sampling_params
from server.request_id import current_request_id


async def render_completion(ctx: ServingContext, body: CompletionRequest) -> list[dict]:
    ctx.check_model(body.model)
    params = to_sampling_params(body, defaults=ctx.generation_defaults)
    await compile_grammar(ctx, params, (body.grammar_source() or (None, None))[1])
    prompts = tokenize_prompts(ctx, body)
    base_id = f"cmpl-{current_request_id()}"
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    return [
        _generate_request(ctx, body, rid, p, params, "prompt") for rid, p in zip(ids, prompts)
    ]


async def render_chat_completion(ctx: ServingContext, body: ChatCompletionRequest) -> dict:
    ctx.check_model(body.model)
    params = to_sampling_params(body, defaults=ctx.generation_defaults)
    plan, params, param = plan_chat_grammar(ctx, body, params)
    await compile_grammar(ctx, params, param)
    tools = body.tools if plan.functions else None
    prompt_ids = render_chat_prompt(
        ctx.tokenizer, body.messages, body.add_generation_prompt, body.add_special_tokens, tools,
        plan=plan,
    )  # fmt: skip
    rid = f"chatcmpl-{current_request_id()}"
    out = _generate_request(ctx, body, rid, prompt_ids, params, "messages")
    out |= {"reasoning_ended": None, "reasoning_parser_kwargs": None}
    return out


def _generate_request(
    ctx: ServingContext, body, request_id: str, prompt_ids: list[int], params, param: str
) -> dict:
    """vLLM's GenerateRequest fields, after the engine's own validation of the request."""
    try:  # validated as the engine would (vocabulary, context length); nothing is queued
        request = ctx.engine.make_request(f"render-{uuid.uuid4().hex}", prompt_ids, params)
    except Exception as e:  # noqa: BLE001 - mapped to 400 / 503 as the generation routes do
        err = engine_error(e)
        if err.param == "prompt":
            err.param = param
        raise err from e
    stream_options = getattr(body, "stream_options", None)
    return {
        "request_id": request_id,
        "token_ids": list(prompt_ids),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params_dict(request.sampling_params),
        "model": body.model,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(body.stream),
        "stream_options": stream_options.model_dump() if stream_options and body.stream else None,
        "cache_salt": getattr(body, "cache_salt", None),
        "priority": getattr(body, "priority", None) or 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def sampling_params_dict(params: SamplingParams) -> dict:
    """Our SamplingParams under vLLM's field names (they are the same names)."""
    out = asdict(params)
    grammar = params.structured_outputs
    out["structured_outputs"] = None if grammar is None else {grammar.kind: grammar.text}
    if params.logit_bias is not None:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out
