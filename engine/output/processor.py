"""Per-request output state between the model runner and the caller: text and logprobs."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.stop_checker import StopChecker
from engine.outputs import PromptLogprobsChunk, TokenLogprobs


class RequestState:
    def __init__(self, tokenizer, request: Request) -> None:
        params = request.sampling_params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens
        )
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        # Entry p scores prompt token p; position 0 has nothing before it.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False

    def process_tokens(self, req: Request, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Delta text for this step's tokens, and the stop string if one completed.

        A token that stopped the request (EOS, stop_token_ids) keeps its id but, as in vLLM,
        adds no text unless include_stop_str_in_output.
        """
        params = req.sampling_params
        ids = new_token_ids
        if req.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            ids = new_token_ids[:-1]
        text = self.detokenizer.step(ids)
        if req.finished:
            text += self.detokenizer.flush()
        can_stop = req.num_output_tokens >= params.min_tokens
        delta, stop_str = self.stop_checker.step(text, can_stop)
        if stop_str is None and req.finished:
            delta += self.stop_checker.flush()
        return delta, stop_str

    def process_token_run(
        self, req: Request, new_token_ids: list[int]
    ) -> tuple[str, str | None, int]:
        """Several tokens of one step (accepted drafts), each handled as its own decode step
        would be: (delta text, the stop string if one completed, tokens kept up to it)."""
        params = req.sampling_params
        num_before = req.num_output_tokens - len(new_token_ids)
        last = len(new_token_ids) - 1
        delta = ""
        for i, token_id in enumerate(new_token_ids):
            ids = [token_id]
            if i == last and req.status == RequestStatus.FINISHED_STOPPED:
                ids = ids if params.include_stop_str_in_output else []
            text = self.detokenizer.step(ids)
            if i == last and req.finished:
                text += self.detokenizer.flush()
            can_stop = num_before + i + 1 >= params.min_tokens
            part, stop_str = self.stop_checker.step(text, can_stop)
            delta += part
            if stop_str is not None:
                return delta, stop_str, i + 1
        if req.finished:
            delta += self.stop_checker.flush()
        return delta, None, len(new_token_ids)

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Appends the positions not seen yet (recompute after preemption repeats some)."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) - chunk.start
        assert skip >= 0, "prompt positions were skipped (prefix cache hit with prompt_logprobs?)"
        if skip < len(chunk.entries):
            self.prompt_logprobs.extend(chunk.entries[skip:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The full prompt logprobs, once: on the request's first output."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs
