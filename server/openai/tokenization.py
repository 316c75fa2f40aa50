"""POST /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

from server.openai.chat import render_chat_prompt
from server.openai.errors import APIError
from server.openai.images import collect_image_refs, expand_prompt, load_images
from server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.openai.serving import ServingContext


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)  # the template carries its own specials
        parts = collect_image_refs(body.messages)  # images count as their placeholder tokens
        pixels = await load_images(ctx, parts) if parts else []
        image_token = ctx.engine.mm_processor.image_token if parts else None
        ids = render_chat_prompt(
            ctx.tokenizer, body.messages, body.add_generation_prompt, add_special, None,
            image_token,
        )  # fmt: skip
        if parts:
            ids = expand_prompt(ctx, ids, pixels)[0]
    else:
        add_special = body.add_special_tokens is None or body.add_special_tokens
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))
