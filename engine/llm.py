"""Offline batch API: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.forks import sample_params
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # dict: vLLM's {"prompt" | "prompt_token_ids", "cache_salt"}


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()
        self._num_samples: dict[str, int] = {}  # request id -> n, while it runs

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in prompt order.

        lora_request (with enable_lora): a served adapter's name, or an object with
        vLLM's LoRARequest fields lora_name and lora_path (loaded, in place, when new)."""
        lora = self._lora_name(lora_request)
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.engine.default_sampling_params()
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            order.append(self._add(prompt, p, results, lora))
        self._run(results, use_tqdm)
        return [results[rid] for rid in order]

    def _lora_name(self, lora_request) -> str | None:
        if lora_request is None or isinstance(lora_request, str):
            return lora_request
        registry = self.engine.lora_registry
        if registry is None:
            raise ValueError("lora_request needs enable_lora=True")
        name, path = lora_request.lora_name, str(lora_request.lora_path)
        known = registry.get(name)
        if known is None or known.path != path:
            registry.load(name, path)
        return name

    def _add(self, prompt: Prompt, params: SamplingParams, results: dict, lora=None) -> str:
        """One engine request, or params.n of them (ids rid#i) forked from the first."""
        rid = str(next(self._ids))
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.n == 1 or params.use_beam_search:  # a beam group answers with n outputs
            self.engine.add_request(rid, ids, params, lora_name=lora, cache_salt=salt)
        else:
            reqs = [
                self.engine.make_request(
                    f"{rid}#{i}", ids, sample_params(params, i), lora_name=lora, cache_salt=salt
                )
                for i in range(params.n)
            ]
            for req in reqs:
                if req is not reqs[0]:
                    req.fork_parent_id = reqs[0].request_id
                self.engine.add(req)
        results[rid] = RequestOutput(
            request_id=rid,
            prompt_token_ids=ids,
            outputs=[],
            finished=False,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self._num_samples[rid] = 1 if params.use_beam_search else params.n
        return rid

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm)
        num_open = {rid: self._num_samples[rid] for rid in results}
        while self.engine.has_unfinished_requests():
            step_outputs, _ = self.engine.step()
            for delta in step_outputs:
                rid, _, index = delta.request_id.partition("#")
                acc = results[rid]
                if len(delta.outputs) > 1:  # beam search: every sequence at once, best first
                    acc.outputs, acc.metrics = list(delta.outputs), delta.metrics
                    acc.num_cached_tokens = delta.num_cached_tokens
                else:
                    _merge(acc, delta, int(index or 0), num_open[rid])
                num_open[rid] -= delta.finished
                acc.finished = not num_open[rid]
                if acc.finished:
                    bar.update(1)
        for rid in results:
            self._num_samples.pop(rid, None)
        bar.close()


def _merge(acc: RequestOutput, delta: RequestOutput, index: int = 0, n: int = 1) -> None:
    """Folds one step's delta of sample `index` into the accumulated output (text, ids,
    logprobs); the outputs are listed by sample index."""
    d = delta.outputs[0]
    out = next((o for o in acc.outputs if o.index == index), None)
    if out is None:
        d.index = index
        d.token_ids = list(d.token_ids)
        d.logprobs = list(d.logprobs) if d.logprobs is not None else None
        acc.outputs.append(d)
        acc.outputs.sort(key=lambda o: o.index)
    else:
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            out.logprobs = (out.logprobs or []) + d.logprobs
        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    acc.num_cached_tokens = (
        delta.num_cached_tokens if n == 1 else max(acc.num_cached_tokens, delta.num_cached_tokens)
    )
    acc.metrics = delta.metrics or acc.metrics
