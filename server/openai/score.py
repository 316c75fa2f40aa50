"""POST /v1/score and /v1/rerank (also /score, /rerank, /v2/rerank) as vLLM serves them.

A cross-encoder (…ForSequenceClassification) reads each (query, document) pair in one input
and scores it by the sigmoid of its logit, as sentence-transformers' CrossEncoder; an embedding
model scores a pair by the cosine similarity of the two embeddings. /v1/score answers OpenAI-
style `data` ({index, object: "score", score}); /v1/rerank answers Cohere/Jina's `results`
({index, document: {text}, relevance_score}), most relevant first, cut to top_n.
"""

from __future__ import annotations

import uuid

import torch
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictStr

from server.openai.embeddings import check_pooling, list_response
from server.openai.errors import APIError
from server.openai.serving import ServingContext


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class RerankDocument(BaseModel):
    text: StrictStr


class RerankRequest(BaseModel):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


async def create_score(ctx: ServingContext, body: ScoreRequest) -> JSONResponse:
    ctx.check_model(body.model)
    check_pooling(ctx, "/v1/score")
    left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not left or not right:
        raise APIError(400, "text_1 and text_2 must not be empty", param="text_2")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        msg = f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 or as many"
        raise APIError(400, msg, param="text_1")
    scores, num_tokens = await score_pairs(ctx, left, right, body.truncate_prompt_tokens)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return list_response(ctx, "score", data, num_tokens)


async def create_rerank(ctx: ServingContext, body: RerankRequest) -> JSONResponse:
    ctx.check_model(body.model)
    check_pooling(ctx, "/v1/rerank")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    if not docs:
        raise APIError(400, "documents must not be empty", param="documents")
    scores, num_tokens = await score_pairs(
        ctx, [body.query] * len(docs), docs, body.truncate_prompt_tokens
    )
    ranked = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n or None]
    results = []
    for i in ranked:
        item = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": ctx.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results,
        }
    )


async def score_pairs(
    ctx: ServingContext, left: list[str], right: list[str], truncate: int | None
) -> tuple[list[float], int]:
    """Each pair's score and the tokens read."""
    limit = _limit(ctx, truncate)
    if ctx.engine.is_cross_encoder:
        enc = [ctx.tokenizer(a, b, **_trunc_kw(limit)) for a, b in zip(left, right)]
        ids = [e["input_ids"] for e in enc]
        _check_lengths(ctx, ids, "text_2")
        types = [e.get("token_type_ids") or [0] * len(e["input_ids"]) for e in enc]
        return await ctx.engine.score(ids, types), sum(len(x) for x in ids)
    texts = list(dict.fromkeys([*left, *right]))  # each distinct text embedded once
    ids = [ctx.tokenizer(t, **_trunc_kw(limit))["input_ids"] for t in texts]
    _check_lengths(ctx, ids, "text_2")
    vecs = dict(zip(texts, await ctx.engine.embed(ids)))
    scores = [
        torch.nn.functional.cosine_similarity(vecs[a], vecs[b], dim=0).item()
        for a, b in zip(left, right)
    ]
    return scores, sum(len(x) for x in ids)


def _limit(ctx: ServingContext, truncate: int | None) -> int | None:
    if truncate is None:
        return None
    if truncate == -1:
        return ctx.max_model_len
    if truncate == 0 or truncate > ctx.max_model_len:
        msg = f"truncate_prompt_tokens must be -1 or between 1 and {ctx.max_model_len}"
        raise APIError(400, msg, param="truncate_prompt_tokens")
    return truncate


def _trunc_kw(limit: int | None) -> dict:
    return {"truncation": True, "max_length": limit} if limit else {}


def _check_lengths(ctx: ServingContext, prompts: list[list[int]], param: str) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) > ctx.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens; input {i} "
                f"has {len(ids)}. Shorten it or set truncate_prompt_tokens (-1: the limit).",
                param=param,
            )
