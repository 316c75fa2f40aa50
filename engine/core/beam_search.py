"""Beam search on copy-on-write forks (no torch): the bookkeeping, step by step.

A request with `use_beam_search` (n = beam width) runs as engine requests, one per live beam,
that share KV through KVCacheManager.fork. Each beam is greedy and asks the sampler for the
top-M logprobs of its next token (log_softmax of the raw float32 logits, the sampler's usual
logprobs; M = max(2, 1 + number of EOS ids) * width, as transformers keeps). The engine takes
the sampled token back off each beam (LLMEngine.step -> BeamSearch.take), so a beam that has
its logprobs owes no token and is not scheduled again; once every live beam of a group has
them, `_advance` runs one step of transformers' beam search (generation/utils.py _beam_search,
float32 scores):

- candidates: every beam's score + each of its top-M logprobs; the best M over all beams;
- a candidate that ends (EOS unless ignore_eos, a stop token id, a stop string, max_tokens)
  becomes a finished hypothesis when it ranks among the best `width` of the M, scored
  sum of logprobs / generated length ** length_penalty (length counts the new token, EOS
  included); the best `width` hypotheses are kept;
- the best `width` candidates that do not end are the next beams: a beam kept by one
  candidate appends its token, one kept by several forks a child per extra candidate (the
  shared partly filled block is copied on the first write), a beam kept by none is freed;
- the search ends when every candidate ends, when all `width` hypotheses are in and
  early_stopping is True, or when no running beam can beat the worst hypothesis (estimated at
  the current length, or at max_tokens for early_stopping "never" with length_penalty > 0).

The result is one RequestOutput with `width` outputs, best first (vLLM's beam search API).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.core.request import Request, RequestRejectedError, RequestStatus
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.sampling_params import SamplingParams

_NEG = -1.0e9  # transformers' score for "no such beam"


def f32(x: float) -> float:
    """x rounded to float32, as transformers' score tensors hold it."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class _Beam:
    req: Request
    score: float  # float32 sum of the generated tokens' logprobs
    top: list[tuple[int, float]] | None = None  # next-token (id, logprob), best first


@dataclass
class Hypothesis:
    score: float  # sum of logprobs / length ** length_penalty (float32)
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    text: str | None = None  # set when a stop string cut it
    logprob_sum: float = 0.0


@dataclass
class BeamGroup:
    request_id: str
    params: SamplingParams  # the user's
    width: int
    num_top: int
    max_new: int
    beams: list[_Beam]
    arrival_time: float
    finished: list[Hypothesis] = field(default_factory=list)
    gen_len: int = 0
    improvable: bool = True
    num_children: int = 0

    @property
    def early_stopping_true(self) -> bool:
        return self.params.early_stopping is True


def check_beam_request(scheduler: Scheduler, params: SamplingParams) -> None:
    """What beam search cannot run with, refused before the request is queued."""
    if scheduler.proposer is not None:
        msg = "use_beam_search is not supported with speculative decoding on this server"
        raise RequestRejectedError(msg, "use_beam_search")
    if params.n > scheduler.max_num_seqs:
        msg = (
            f"n ({params.n}) is the beam width and may not exceed max_num_seqs "
            f"({scheduler.max_num_seqs}): ask for fewer beams or raise --max-num-seqs"
        )
        raise RequestRejectedError(msg, "n")


class BeamSearch:
    """The engine's beam groups; LLMEngine hooks: add, take, abort."""

    def __init__(self, scheduler: Scheduler, decode: Callable[[list[int], bool], str]) -> None:
        self.sched = scheduler
        self.decode = decode  # (output ids, skip_special_tokens) -> text: stop strings, results
        self.groups: dict[str, BeamGroup] = {}
        self.owner: dict[str, BeamGroup] = {}  # engine request id of a live beam -> group

    def add(self, req: Request) -> None:
        """Queues the group's first beam (its id is the user's request id)."""
        params = req.sampling_params
        eos = {req.eos_token_id, *req.eos_token_ids} - {None}
        num_eos = 0 if params.ignore_eos else len(eos)
        width = params.n
        max_new = min(params.max_tokens, self.sched.max_model_len - req.num_prompt_tokens)
        internal = replace(
            params, n=1, temperature=0.0, use_beam_search=False, stop=[], stop_token_ids=[],
            ignore_eos=True, max_tokens=max_new + 1, seed=None,
        )  # fmt: skip
        internal.logprobs = max(2, 1 + num_eos) * width  # past MAX_LOGPROBS: internal only
        req.sampling_params = internal
        req.extra_seats = width - 1  # the forks' seats, held from admission (Scheduler)
        group = BeamGroup(
            req.request_id, params, width, internal.logprobs, max_new, [_Beam(req, 0.0)],
            req.arrival_time,
        )  # fmt: skip
        self.groups[req.request_id] = group
        self.owner[req.request_id] = group
        self.sched.add_request(req)

    def take(self, results: list, logprobs: dict) -> tuple[list, list[RequestOutput]]:
        """Splits a step's (request, new ids): the beams' are consumed (their token taken back,
        their top logprobs kept); returns the others and the outputs of groups that ended."""
        if not self.owner:
            return results, []
        rest, touched = [], {}
        for req, new_ids in results:
            group = self.owner.get(req.request_id)
            if group is None:
                rest.append((req, new_ids))
                continue
            del req.all_token_ids[len(req.all_token_ids) - len(new_ids) :]
            for beam in group.beams:
                if beam.req is req:
                    beam.top = logprobs[req.request_id].top
            touched[group.request_id] = group
        outputs = [self._advance(g) for g in touched.values()]
        return rest, [o for o in outputs if o is not None]

    def abort(self, request_ids: list[str]) -> tuple[list[str], list[RequestOutput]]:
        """The ids that are not beam groups, and an aborted output per group among them."""
        rest, outputs = [], []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                rest.append(rid)
            else:
                outputs.append(self._end(group, RequestStatus.FINISHED_ABORTED))
        return rest, outputs

    # ---- one step ----------------------------------------------------------------------------
    def _ready(self, beam: _Beam) -> bool:
        req = beam.req
        return beam.top is not None and (
            req.finished or req.num_computed_tokens == len(req.all_token_ids)
        )

    def _advance(self, g: BeamGroup) -> RequestOutput | None:
        if not all(self._ready(b) for b in g.beams):
            return None  # a beam still computing (a prefill chunk, a recompute)
        cands = [
            (f32(b.score + lp), i, b, tok)
            for i, b in enumerate(g.beams)
            for tok, lp in b.top  # type: ignore[union-attr]
        ]
        cands.sort(key=lambda c: (-c[0], c[1]))  # stable: beam order, then rank
        cands = cands[: g.num_top]
        g.gen_len += 1
        ends = [self._ending(g, b, tok) for _, _, b, tok in cands]
        self._add_finished(g, cands, ends)
        running = [c for c, e in zip(cands, ends) if e is None][: g.width]
        self._update_improvable(g, running)
        all_in = len(g.finished) == g.width
        if not g.improvable or not running or (all_in and g.early_stopping_true):
            return self._end(g, None)
        self._continue(g, running)
        return None

    def _ending(self, g: BeamGroup, beam: _Beam, tok: int) -> Hypothesis | None:
        """The hypothesis beam + tok would be if it ends here (score filled in later)."""
        params, req = g.params, beam.req
        tokens = req.output_token_ids + [tok]
        if params.stop:
            text = self.decode(tokens, params.skip_special_tokens)
            for s in params.stop:
                at = text.find(s)
                if at >= 0:
                    cut = text[: at + len(s)] if params.include_stop_str_in_output else text[:at]
                    return Hypothesis(0.0, tokens, "stop", s, cut)
        if not params.ignore_eos and (tok == req.eos_token_id or tok in req.eos_token_ids):
            return Hypothesis(0.0, tokens, "stop")
        if tok in params.stop_token_ids:
            return Hypothesis(0.0, tokens, "stop", tok)
        if g.gen_len >= g.max_new:
            return Hypothesis(0.0, tokens, "length")
        return None

    def _add_finished(self, g: BeamGroup, cands: list, ends: list) -> None:
        if len(g.finished) == g.width and g.early_stopping_true:
            return
        denom = f32(g.gen_len**g.params.length_penalty)
        for (score, _, _, _), hyp in zip(cands[: g.width], ends):
            if hyp is not None:
                hyp.score, hyp.logprob_sum = f32(score / denom), score
                g.finished.append(hyp)
        g.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses first on ties
        del g.finished[g.width :]

    def _update_improvable(self, g: BeamGroup, running: list) -> None:
        if len(g.finished) < g.width or not g.improvable:
            return
        penalty = g.params.length_penalty
        length = g.max_new if g.params.early_stopping == "never" and penalty > 0 else g.gen_len
        best = running[0][0] if running else _NEG
        best = f32(best / f32(length**penalty))
        g.improvable = best > min(h.score for h in g.finished)

    def _continue(self, g: BeamGroup, running: list) -> None:
        """The next beams: kept, forked or freed."""
        bases = {id(b): list(b.req.all_token_ids) for b in g.beams}
        kept: set[str] = set()
        beams = []
        for score, _, parent, tok in running:
            req = parent.req
            if req.request_id in kept:
                req = self._fork(g, req, bases[id(parent)])
            kept.add(req.request_id)
            req.all_token_ids.append(tok)
            beams.append(_Beam(req, score))
        for b in g.beams:
            b.req.extra_seats = 0  # the forks now hold their seats themselves
        self._free([b.req for b in g.beams if b.req.request_id not in kept])
        g.beams = beams

    def _fork(self, g: BeamGroup, parent: Request, tokens: list[int]) -> Request:
        g.num_children += 1
        child = Request(
            f"{g.request_id}-beam{g.num_children}", parent.prompt_token_ids,
            parent.sampling_params, eos_token_id=parent.eos_token_id,
            arrival_time=parent.arrival_time, eos_token_ids=parent.eos_token_ids,
        )  # fmt: skip
        child.all_token_ids = list(tokens)
        child.cache_salt, child.mm_spans = parent.cache_salt, parent.mm_spans
        child.mm_inputs, child.lora_request = parent.mm_inputs, parent.lora_request
        sched = self.sched
        sched.requests[child.request_id] = child
        sched.kv_cache_manager.fork(parent, child, parent.num_computed_tokens)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time = parent.first_token_time
        sched.running.append(child)
        sched._tables_to_reset.add(child.request_id)  # new to the runner: the whole table
        sched.num_forks_total += 1
        self.owner[child.request_id] = g
        return child

    def _free(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.owner.pop(req.request_id, None)
        self.sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)

    # ---- the result --------------------------------------------------------------------------
    def _end(self, g: BeamGroup, aborted: RequestStatus | None) -> RequestOutput:
        root = g.beams[0].req if g.beams else None
        self._free([b.req for b in g.beams])
        del self.groups[g.request_id]
        now = time.monotonic()
        hyps = [] if aborted is not None else g.finished
        outputs = [self._completion(g, i, h) for i, h in enumerate(hyps)]
        if aborted is not None:
            outputs = [CompletionOutput(0, "", [], finish_reason="abort")]
        num_gen = sum(len(h.token_ids) for h in hyps)
        metrics = RequestMetrics(
            arrival_time=g.arrival_time,
            first_scheduled_time=root.first_scheduled_time if root else None,
            first_token_time=root.first_token_time if root else None,
            finished_time=now,
            num_prompt_tokens=root.num_prompt_tokens if root else 0,
            num_generation_tokens=num_gen,
            num_preemptions=root.num_preemptions if root else 0,
            request_id=g.request_id,
        )
        return RequestOutput(
            request_id=g.request_id,
            prompt_token_ids=root.prompt_token_ids if root else [],
            outputs=outputs,
            finished=True,
            num_cached_tokens=max(root.num_cached_tokens, 0) if root else 0,
            metrics=metrics,
        )

    def _completion(self, g: BeamGroup, index: int, h: Hypothesis) -> CompletionOutput:
        text = h.text
        if text is None:
            text = self.decode(h.token_ids, g.params.skip_special_tokens)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=h.token_ids,
            finish_reason=h.finish_reason,
            stop_reason=h.stop_reason,
            cumulative_logprob=h.logprob_sum,
        )
