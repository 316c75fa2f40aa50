"""Speculative decoding, verification side: the target model's logits judge the drafts.

Drafting is in engine/spec_decode/ (ngram.py: the config and the n-gram proposer, no torch). The
two meet through the scheduler and the runner: the scheduler asks the proposer for K drafts and
schedules the request's newest token plus its drafts as one chunk of 1 + K query tokens
(SchedulerOutput.spec_token_ids); the runner takes the 1 + K logits rows of that chunk to
`RejectionSampler.verify` here, and the scheduler's update_from_output appends the tokens it
returns (accepted drafts, then one more) and gives back the blocks of the rejected ones.

Each position's logits go through the same processors as a plain decode step at that position
(penalties and min_tokens see the drafts before it as output), then greedy rows accept the
longest prefix of drafts equal to the argmax and random rows use rejection sampling against the
one-hot draft distribution; either way one more token follows from the first unaccepted
position. Seeded requests draw from the Sampler's generator of that request, so the tokens are
distributed exactly as plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import Request
from engine.outputs import TokenLogprobs
from engine.sample.logprobs import token_logprobs
from engine.sample.sampler import (
    Sampler,
    apply_logits_processors,
    sample_inverse_cdf,
    sampling_probs,
)

__all__ = ["RejectionSampler", "VerifyOutput"]


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then the bonus token
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per token


class _DraftPosition:
    """A request as the logits processors see it at one draft position: its output so far
    plus the drafts before this position."""

    __slots__ = (
        "request_id", "sampling_params", "prompt_token_ids", "output_token_ids",
        "eos_token_id", "eos_token_ids",
    )

    def __init__(self, req: Request, drafts: list[int]) -> None:
        self.request_id = req.request_id
        self.sampling_params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = req.output_token_ids + drafts
        self.eos_token_id, self.eos_token_ids = req.eos_token_id, req.eos_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class RejectionSampler:
    """Verifies drafts with a Sampler's state: its per-request generators and prompt masks, and
    its argmax (the CPU kernel or torch's)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(
        self,
        logits: torch.Tensor,  # [sum(len(d) + 1), vocab] raw; request r's 1 + len(d_r) rows
        requests: list[Request],  # never constrained by a grammar
        drafts: list[list[int]],
    ) -> VerifyOutput:
        """Accepted drafts plus one token per request, distributed exactly as plain decoding.

        Random rows: draft t is accepted with probability p(t) (the draft distribution is
        one-hot); on rejection the token comes from p with t removed and renormalised, and
        after K acceptances the bonus token from the last row's p.
        """
        sampler = self.sampler
        positions = [
            _DraftPosition(req, d[:j])
            for req, d in zip(requests, drafts)
            for j in range(len(d) + 1)
        ]
        processed = apply_logits_processors(logits, positions, sampler.prompt_mask)
        params = [p.sampling_params for p in positions]
        targets = sampler.argmax_rows(processed).tolist() if any(p.greedy for p in params) else None
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = None
        if random_rows:
            probs = torch.zeros_like(processed)
            random_params = [params[i] for i in random_rows]
            probs[random_rows] = sampling_probs(processed[random_rows], random_params)
        token_ids, base = [], 0
        for req, d in zip(requests, drafts):
            if req.sampling_params.greedy:
                a = 0
                while a < len(d) and targets[base + a] == d[a]:
                    a += 1
                token_ids.append(d[:a] + [targets[base + a]])
            else:
                token_ids.append(self._rejection_sample(req, d, probs[base : base + len(d) + 1]))
            base += len(d) + 1
        return VerifyOutput(token_ids, _verify_logprobs(logits, requests, drafts, token_ids))

    def _rejection_sample(self, req: Request, drafts: list[int], probs: torch.Tensor) -> list[int]:
        """probs: [len(drafts) + 1, vocab], the target distribution at each position."""
        gen = self.sampler.generator_for(req.request_id, req.sampling_params)
        dev = probs.device
        draft_ids = torch.tensor(drafts, device=dev)
        p_draft = probs[torch.arange(len(drafts), device=dev), draft_ids].tolist()
        u = torch.rand(len(drafts) + 1, generator=gen, device=dev).tolist()
        for j, (t, p) in enumerate(zip(drafts, p_draft)):
            if u[j] < p:
                continue
            residual = probs[j].clone()
            residual[t] = 0.0  # p minus the one-hot draft, renormalised by the draw below
            return drafts[:j] + [_draw(residual, gen)]
        return drafts + [_draw(probs[-1], gen)]


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:  # probs: [vocab]
    u = torch.rand(1, 1, generator=gen, device=probs.device)
    return int(sample_inverse_cdf(probs[None], u)[0])


def _verify_logprobs(logits, requests, drafts, token_ids) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of each emitted token from the raw logits of its position."""
    result: dict[str, list[TokenLogprobs]] = {}
    base = 0
    for req, d, toks in zip(requests, drafts, token_ids):
        k = req.sampling_params.logprobs
        if k is not None:
            rows = logits[base : base + len(toks)].log_softmax(dim=-1)  # [T, vocab]
            ids = torch.tensor(toks, device=logits.device)
            result[req.request_id] = token_logprobs(rows, ids, [k] * len(toks))
        base += len(d) + 1
    return result
