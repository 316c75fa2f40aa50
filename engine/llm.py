"""Offline batch API: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
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
        rid = str(next(self._ids))
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.add_request(rid, ids, params, lora_name=lora)
        results[rid] = RequestOutput(
            request_id=rid,
            prompt_token_ids=ids,
            outputs=[],
            finished=False,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        return rid

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            step_outputs, _ = self.engine.step()
            for delta in step_outputs:
                _merge(results[delta.request_id], delta)
                if delta.finished:
                    bar.update(1)
        bar.close()


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    """Folds one step's delta into the accumulated output (text, ids, logprobs)."""
    d = delta.outputs[0]
    if not acc.outputs:
        acc.outputs = [d]
        d.token_ids = list(d.token_ids)
        d.logprobs = list(d.logprobs) if d.logprobs is not None else None
    else:
        out = acc.outputs[0]
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            out.logprobs = (out.logprobs or []) + d.logprobs
        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    acc.finished = delta.finished
    acc.num_cached_tokens = delta.num_cached_tokens
    acc.metrics = delta.metrics or acc.metrics
