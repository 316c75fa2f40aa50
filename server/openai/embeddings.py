"""POST /v1/embeddings (OpenAI's shape, with vLLM's truncate_prompt_tokens and
add_special_tokens), served by a pooling model (engine/pooling_engine.py).

Every refusal (empty input, token ids out of the vocabulary, inputs past max_model_len without
truncation, `dimensions` on a model not trained for truncation) is a 400 naming the field, before
the engine sees the request.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictInt, StrictStr

from server.openai.errors import APIError, engine_error
from server.openai.serving import ServingContext

EmbeddingInput = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    # vLLM's extras: -1 truncates to max_model_len, k keeps k tokens; None refuses longer inputs
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True


def check_pooling(ctx: ServingContext, endpoint: str) -> None:
    """400 unless the served model is a pooling model."""
    if getattr(ctx.engine, "runner_type", "generate") != "pooling":
        raise APIError(
            400,
            f"{endpoint} needs a pooling model (embeddings); `{ctx.model_name}` is a generating "
            "model. Serve an embedding model (e.g. `pagedserve serve all-MiniLM-L6-v2`, or any "
            "model with --runner pooling)",
            param="model",
        )


async def create_embedding(ctx: ServingContext, body: EmbeddingRequest) -> JSONResponse:
    ctx.check_model(body.model)
    check_pooling(ctx, "/v1/embeddings")
    if ctx.engine.is_cross_encoder:
        msg = f"`{ctx.model_name}` is a cross-encoder: it scores pairs (/v1/score, /v1/rerank)"
        raise APIError(400, msg, param="model")
    check_dimensions(ctx, body.dimensions)
    prompts = tokenize_inputs(ctx, body)
    try:
        vecs = await ctx.engine.embed(prompts, body.dimensions)
    except (ValueError, RuntimeError) as e:  # refused by the engine, queue full, engine dead
        raise engine_error(e) from e
    num_tokens = sum(len(p) for p in prompts)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
        for i, v in enumerate(vecs)
    ]
    return list_response(ctx, "embd", data, num_tokens)


def list_response(ctx: ServingContext, id_prefix: str, data: list, num_tokens: int):
    """OpenAI's list envelope (embeddings; vLLM's score answers in the same shape)."""
    return JSONResponse(
        {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": ctx.model_name,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )


def check_dimensions(ctx: ServingContext, dimensions: int | None) -> None:
    if dimensions is None:
        return
    pooling = ctx.engine.pooling
    if not pooling.matryoshka:
        raise APIError(
            400,
            f"model `{ctx.model_name}` does not support Matryoshka representation (it was not "
            "trained for truncated embeddings); leave `dimensions` unset",
            param="dimensions",
        )
    size = ctx.engine.hidden_size
    if not 1 <= dimensions <= size:
        raise APIError(400, f"dimensions must be between 1 and {size}", param="dimensions")


def tokenize_inputs(ctx: ServingContext, body: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids, truncated per truncate_prompt_tokens or refused when too long."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    limit = _truncation(ctx, body.truncate_prompt_tokens)
    prompts = [_to_ids(ctx, x, body, limit) for x in inputs]
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"input {i} is empty (no tokens)", param="input")
        if len(ids) > ctx.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                f"input {i} has {len(ids)} tokens. Please reduce the length of the input, or "
                "set truncate_prompt_tokens (-1 truncates to the model's limit).",
                param="input",
            )
        bad = next((t for t in ids if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            msg = f"token id {bad} is out of the vocabulary (size {ctx.vocab_size})"
            raise APIError(400, msg, param="input")
    return prompts


def _truncation(ctx: ServingContext, value: int | None) -> int | None:
    if value is None:
        return None
    if value == -1:
        return ctx.max_model_len
    if value == 0 or value > ctx.max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens must be -1 or between 1 and max_model_len "
            f"({ctx.max_model_len}), got {value}",
            param="truncate_prompt_tokens",
        )
    return value


def _to_ids(ctx: ServingContext, x, body: EmbeddingRequest, limit: int | None) -> list[int]:
    """Text through the tokenizer (its truncation side); token ids keep their first `limit`."""
    if isinstance(x, str):
        kw = {"truncation": True, "max_length": limit} if limit else {}
        return ctx.tokenizer(x, add_special_tokens=body.add_special_tokens, **kw)["input_ids"]
    return list(x[:limit]) if limit else list(x)


def _encode(vec, encoding_format: str):
    arr = vec.numpy().astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(arr.tobytes()).decode("ascii")
    return np.asarray(arr, dtype=np.float64).tolist()
