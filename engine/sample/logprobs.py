"""Logprobs of the model's raw distribution (log_softmax of the unprocessed logits).

Sampled tokens get theirs from the sampler; prompt tokens from the extra logits rows below.
Prompt position p (p >= 1) is scored by the row of position p - 1, so a chunk that computes
positions [start, start + n) yields entries for prompt positions start + 1 .. start + n, capped
at the last prompt token (the row after it predicts the first output token instead).
"""

from __future__ import annotations

import torch

from engine.core.scheduler import SchedulerOutput
from engine.outputs import PromptLogprobsChunk, TokenLogprobs

_MAX_PROMPT_ROWS = 512  # logits rows per matmul, so a long prompt never holds [T, vocab] at once


def token_logprobs(
    logprobs: torch.Tensor,  # [M, vocab] log_softmax of raw logits
    token_ids: torch.Tensor,  # [M] the chosen tokens
    num_top: list[int],  # top-k size per row (0: only the chosen token)
) -> list[TokenLogprobs]:
    """Chosen token's logprob and rank (1 = most likely) plus the top-k, best first."""
    chosen = logprobs.gather(-1, token_ids[:, None])  # [M, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [M]
    max_k = max(num_top, default=0)
    top_vals, top_ids = [], []
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)  # values/indices: [M, max_k], best first
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    rows = zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), num_top)
    return [
        TokenLogprobs(
            token_id=tok,
            logprob=lp,
            rank=rank,
            top=list(zip(top_ids[i][:k], top_vals[i][:k])) if k else [],
        )
        for i, (tok, lp, rank, k) in enumerate(rows)
    ]


def compute_prompt_logprobs(
    model,
    hidden: torch.Tensor,  # [T, hidden] this step's flat rows, requests in SchedulerOutput order
    out: SchedulerOutput,
) -> dict[str, PromptLogprobsChunk]:
    """Prompt logprobs for every request that asked and computed prompt rows this step."""
    result: dict[str, PromptLogprobsChunk] = {}
    if all(r.sampling_params.prompt_logprobs is None for r in out.requests):
        return result
    row = 0
    for req, n, start in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
        k = req.sampling_params.prompt_logprobs
        end = min(start + n, req.num_prompt_tokens - 1)  # rows whose next token is a prompt token
        if k is not None and end > start:
            targets = req.prompt_token_ids[start + 1 : end + 1]
            entries = _score_rows(model, hidden[row : row + end - start], targets, k)
            result[req.request_id] = PromptLogprobsChunk(start=start + 1, entries=entries)
        row += n
    return result


def _score_rows(model, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    entries: list[TokenLogprobs] = []
    for lo in range(0, len(targets), _MAX_PROMPT_ROWS):
        part = hidden[lo : lo + _MAX_PROMPT_ROWS]
        logprobs = model.compute_logits(part).log_softmax(dim=-1)  # [R, vocab] float32
        ids = torch.tensor(targets[lo : lo + len(part)], device=logprobs.device)
        entries += token_logprobs(logprobs, ids, [k] * len(part))
    return entries
