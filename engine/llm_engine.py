"""LLMEngine: add / abort / step. One step = schedule -> execute -> update -> detokenize."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.core.beam_search import BeamSearch, check_beam_request
from engine.core.request import Request, RequestRejectedError, RequestStatus, check_cache_salt
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.distributed import check_tensor_parallel
from engine.executor.executor import create_executor
from engine.kv_events import create_publisher, to_events
from engine.kv_offload.setup import attach_kv_offload
from engine.lora.registry import LoRARegistry, lora_unavailable
from engine.lora.request import LoRAError
from engine.model_loader.loader import resolve_model
from engine.model_loader.weight_loader import check_tokenizer
from engine.multimodal.processor import ImageInputProcessor
from engine.output.processor import RequestState
from engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    StepStats,
    TokenLogprobs,
)
from engine.sample.structured_output import GrammarCompiler
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.spec_decode.ngram import SpecDecodeStats
from engine.startup_log import quiet_tokenizer, ready_line

logger = logging.getLogger(__name__)

_SPEC_LOG_INTERVAL = 10.0  # seconds between speculative decoding log lines


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_dir = resolve_model(config.model, config.mmproj)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        if config.runner == "pooling":  # engine/pooling_llm.py: Qwen3Model runs as its LM class
            from engine.runner.pooling_runner import decoder_architecture

            self.hf_config.architectures = [decoder_architecture(self.hf_config)]
        # the text model's config: the config itself, or a vision-language model's text_config
        self.text_config = self.hf_config.get_text_config()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        quiet_tokenizer(self.tokenizer)
        check_tokenizer(self.tokenizer, self.text_config, self.model_dir)
        self.config = resolve_config(config, self.text_config)
        self.model_name = config.served_model_name or _default_model_name(config.model)
        check_tensor_parallel(self.text_config, self.config.tensor_parallel_size)
        # images in (None: a text-only model): engine/multimodal/processor.py
        self.mm_processor = ImageInputProcessor.build(
            self.model_dir, self.hf_config, self.tokenizer, self.config.max_images_per_prompt,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )  # fmt: skip
        if self.mm_processor is not None and self.config.tensor_parallel_size > 1:
            _check_tp_images(self.hf_config.model_type)
        self.executor = create_executor(self.config, self.model_dir, self.hf_config)
        self.scheduler = Scheduler(self.config, self.executor.num_blocks, self.executor.kv_windows)
        self.beams = BeamSearch(self.scheduler, self._decode)
        self.lora_registry = (  # the served LoRA adapters by name (--lora-modules)
            LoRARegistry(self.config, self.executor, self.model_name)
            if self.config.enable_lora
            else None
        )
        self.generation_config = read_generation_config(self.model_dir)
        self.eos_token_ids = declared_eos_ids(self.text_config, self.generation_config)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = min(self.eos_token_ids)
        self.generation_defaults = generation_defaults(self.generation_config)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.vocab_size, self.config.grammar_compile_timeout
        )
        self.request_states: dict[str, RequestState] = {}
        self.last_token_time: dict[str, float] = {}
        self.aborted_metrics: list[RequestMetrics] = []  # reported with the next stats
        spec = self.config.speculative_config
        # sums since start, logged every _SPEC_LOG_INTERVAL seconds while drafts run
        self.spec_decode_totals = (
            SpecDecodeStats.empty(spec.num_speculative_tokens) if spec is not None else None
        )
        self._spec_logged_at = time.monotonic()
        # KV-cache events: the scheduler runs here, in rank 0's process, so they go out once
        self.kv_events = create_publisher(self.config.kv_events_config)
        if self.kv_events is not None:
            self.scheduler.kv_cache_manager.enable_kv_events()
        self.kv_offload = attach_kv_offload(self)  # the second KV tier (None: off)
        logger.info("%s", ready_line(self, config.max_model_len))

    @property
    def runner(self):
        """The in-thread ModelRunner (uni executor only; tests swap its sampler)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stops the model's worker processes, if any, and the KV-event publisher."""
        if self.kv_offload is not None:  # before the runner goes: the pool is flushed to disk
            self.kv_offload.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (as vLLM applies them
        to requests that leave the fields unset)."""
        return SamplingParams(**self.generation_defaults)

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    # ---- requests ----------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_inputs: list | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Builds and validates a request, once, for the server and the offline API alike.

        RequestRejectedError (a ValueError naming `param`) for anything that can never run:
        token ids outside the vocabulary, the context length, a KV pool too small. A None
        max_tokens becomes what max_model_len leaves after the prompt.
        """
        vocab = self.vocab_size  # one config lookup, not one per prompt token
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            msg = f"token id {bad} is out of the vocabulary (size {vocab})"
            raise RequestRejectedError(msg, "prompt")
        for token_id in params.logit_bias or {}:
            if not 0 <= int(token_id) < vocab:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias token id {token_id} is out of the vocabulary"
                )
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_id,
            eos_token_ids=self.eos_token_ids,
        )
        req.cache_salt = check_cache_salt(cache_salt)  # the tenant's; never shares blocks
        if mm_inputs:  # ImageInputs from self.mm_processor.expand
            if self.mm_processor is None:
                msg = f"model {self.model_name!r} does not take images; send text only"
                raise RequestRejectedError(msg, "messages", "model_not_multimodal")
            req.mm_inputs, req.mm_spans = list(mm_inputs), [i.span for i in mm_inputs]
        self.scheduler.check_fits(req)
        if lora_name is not None:
            self._set_lora(req, lora_name)
        if params.max_tokens is None:
            left = self.config.max_model_len - req.num_prompt_tokens
            req.sampling_params = replace(params, max_tokens=left)
        if params.use_beam_search:
            check_beam_request(self.scheduler, params)
        if params.structured_outputs is not None:  # the server compiled it already: a cache hit
            req.grammar = self.grammar_compiler.compile(params.structured_outputs).new_matcher()
        return req

    def _set_lora(self, req: Request, lora_name: str) -> None:
        """The request runs under the adapter; its KV is keyed by the adapter's content."""
        lora = self.lora_registry.get(lora_name) if self.lora_registry else None
        if lora is None:
            msg = f"The model `{lora_name}` does not exist."
            raise RequestRejectedError(msg, "model", "model_not_found")
        try:  # in memory from here to the request's end; else refused now, never in a step
            self.executor.admit_lora(lora, req)
        except LoRAError as e:
            raise RequestRejectedError(lora_unavailable(lora_name, e), "model") from None
        req.lora_request = lora

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.add(self.make_request(
            request_id, prompt_token_ids, params, lora_name=lora_name, cache_salt=cache_salt))

    def add(self, req: Request) -> None:
        """Queues a request built by make_request (nothing is checked twice)."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        if req.sampling_params.use_beam_search:
            return self.beams.add(req)  # engine/core/beam_search.py: no detokenizer state
        self.scheduler.add_request(req)
        self.request_states[req.request_id] = RequestState(self.tokenizer, req)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        request_ids, beam_outputs = self.beams.abort(request_ids)
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [self._make_output(req, [], "", time.monotonic()) for req in finished]
        outputs += beam_outputs
        self.aborted_metrics.extend(out.metrics for out in outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- step --------------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        t0 = time.monotonic()
        sched_out = self.scheduler.schedule()
        # Called on an empty batch too: the runner frees what finished_req_ids names.
        runner_out = self.executor.execute(sched_out)
        results = self.scheduler.update_from_output(sched_out, runner_out)
        results, outputs = self.beams.take(results, runner_out.logprobs)  # beam search's steps
        for rid, chunk in runner_out.prompt_logprobs.items():
            if rid in self.request_states:
                self.request_states[rid].add_prompt_logprobs(chunk)
        now = time.monotonic()
        stats = self._step_stats(sched_out, now - t0)
        for req, new_ids in results:
            self._record_itl(req, now, stats)
            state = self.request_states[req.request_id]
            if req.request_id not in runner_out.spec_token_ids:
                delta, stop_str = state.process_tokens(req, new_ids)
                logprobs = runner_out.logprobs.get(req.request_id)
            else:  # accepted drafts: tokens after a stop string are dropped
                delta, stop_str, kept = state.process_token_run(req, new_ids)
                logprobs = runner_out.spec_logprobs.get(req.request_id)
                if stop_str is not None and kept < len(new_ids):
                    self.scheduler.finish_by_stop_string(req, stop_str, len(new_ids) - kept)
                    stop_str, new_ids = None, new_ids[:kept]
                logprobs = logprobs[: len(new_ids)] if logprobs is not None else None
            if stop_str is not None:
                self.scheduler.finish_by_stop_string(req, stop_str)
            stats.num_generation_tokens += len(new_ids)
            outputs.append(self._make_output(req, new_ids, delta, now, logprobs))
        _attach_pooled(outputs, runner_out.pooler_output)  # pooling requests: their vectors
        for out in outputs:
            if out.finished:
                stats.finished.append(out.metrics)
                stats.finished_reasons.append(out.outputs[0].finish_reason)
        if sched_out.spec_stats is not None:
            self._add_spec_stats(sched_out.spec_stats, now)
        if self.kv_events is not None:
            self.publish_kv_events()
        return outputs, stats

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def publish_kv_events(self) -> None:
        """This step's KV-cache events as one batch (none: nothing is sent)."""
        log = self.scheduler.kv_cache_manager.take_kv_events()
        if log:
            windows = self.executor.kv_windows
            self.kv_events.publish(to_events(log, self.config.block_size, windows))

    def _add_spec_stats(self, step: SpecDecodeStats, now: float) -> None:
        total = self.spec_decode_totals
        total.num_drafts += step.num_drafts
        total.num_draft_tokens += step.num_draft_tokens
        total.num_accepted_tokens += step.num_accepted_tokens
        for pos, n in enumerate(step.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[pos] += n
        if now - self._spec_logged_at >= _SPEC_LOG_INTERVAL:
            self._spec_logged_at = now
            logger.info(
                "speculative decoding: drafts=%d draft_tokens=%d accepted=%d (%.1f%%) "
                "accepted per position=%s",
                total.num_drafts,
                total.num_draft_tokens,
                total.num_accepted_tokens,
                100.0 * total.num_accepted_tokens / max(total.num_draft_tokens, 1),
                total.num_accepted_tokens_per_pos,
            )

    def _record_itl(self, req: Request, now: float, stats: StepStats) -> None:
        last = self.last_token_time.get(req.request_id)
        if last is not None:
            stats.inter_token_latencies.append(now - last)
        self.last_token_time[req.request_id] = now

    def _make_output(
        self,
        req: Request,
        new_ids: list[int],
        delta: str,
        now: float,
        logprobs: TokenLogprobs | list[TokenLogprobs] | None = None,
    ):
        metrics = None
        state = self.request_states.get(req.request_id)
        prompt_logprobs = state.take_prompt_logprobs() if state and new_ids else None
        if req.finished:
            self.request_states.pop(req.request_id, None)
            self.last_token_time.pop(req.request_id, None)
            metrics = RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=now,
                num_prompt_tokens=req.num_prompt_tokens,
                num_generation_tokens=req.num_output_tokens,
                num_preemptions=req.num_preemptions,
                request_id=req.request_id,
            )
        completion = CompletionOutput(
            index=0,
            text=delta,
            token_ids=list(new_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=[logprobs] if isinstance(logprobs, TokenLogprobs) else logprobs,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
        )

    def snapshot_stats(self) -> StepStats:
        """Gauges without a step (after aborts on an idle engine)."""
        return self._step_stats(SchedulerOutput(), 0.0)

    def _step_stats(self, out: SchedulerOutput, step_time: float) -> StepStats:
        kv = self.scheduler.kv_cache_manager
        pool = kv.block_pool
        prefix = kv.take_prefix_cache_stats()
        num_prompt = sum(
            max(0, min(c + n, r.num_prompt_tokens) - c)
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        )
        aborted, self.aborted_metrics = self.aborted_metrics, []
        return StepStats(
            finished=aborted,
            finished_reasons=["abort"] * len(aborted),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_scheduled_tokens=out.total_num_scheduled_tokens,
            num_prompt_tokens=num_prompt,
            num_preemptions=len(out.preempted),
            prefix_cache_queries=prefix.num_queries,
            prefix_cache_hits=prefix.num_hits,
            kv_cache_usage=pool.get_usage(),
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_free_blocks=pool.get_num_cached_free_blocks(),
            step_time=step_time,
            lora_info=self._lora_info(),
            **_spec_stats(out),
            **self._mm_stats(),
        )

    def _mm_stats(self) -> dict[str, int]:
        """The encoder's work this step (images run only in the uni executor's runner)."""
        mm = getattr(getattr(self.executor, "runner", None), "mm", None)
        return mm.take_stats() if mm is not None else {}

    def _lora_info(self) -> tuple[int, str, str] | None:
        if self.lora_registry is None:
            return None
        sched = self.scheduler

        def names(reqs) -> str:
            return ",".join(sorted({r.lora_request.name for r in reqs if r.lora_request}))

        return self.config.max_loras, names(sched.running), names(sched.waiting)


def _attach_pooled(outputs: list[RequestOutput], pooled: dict) -> None:
    for out in outputs if pooled else ():
        out.pooled_output = pooled.get(out.request_id)


def _spec_stats(out: SchedulerOutput) -> dict:
    """The step's speculative decoding counters as StepStats fields."""
    s = out.spec_stats
    if s is None:
        return {}
    return dict(
        num_spec_drafts=s.num_drafts,
        num_spec_draft_tokens=s.num_draft_tokens,
        num_spec_accepted_tokens=s.num_accepted_tokens,
        num_spec_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos,
    )


def resolve_config(config: EngineConfig, hf_config) -> EngineConfig:
    """The config with what the model decides filled in (max_model_len), the same on every host
    (a headless node builds its ranks from it too)."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if config.max_model_len is None:
        return replace(config, max_model_len=model_max)
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit {model_max}"
        )
    return config


# generation_config.json keys that become SamplingParams defaults (vLLM's list, less max_tokens)
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(model_dir) -> dict:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def declared_eos_ids(hf_config, generation_config: dict) -> frozenset[int]:
    """Every EOS id config.json and generation_config.json declare (an int or a list each)."""
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), generation_config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def generation_defaults(generation_config: dict) -> dict:
    """SamplingParams keyword defaults from generation_config.json (do_sample is not read, as
    in vLLM)."""
    return {k: generation_config[k] for k in _GENERATION_DEFAULTS if k in generation_config}


def _default_model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/")


def _check_tp_images(model_type: str) -> None:
    """Images above one rank: the vision-language models tested at tensor-parallel size 2."""
    if model_type not in ("llava", "qwen2_5_vl", "gemma3"):
        raise ValueError(
            f"images with tensor_parallel_size > 1: LLaVA, Qwen2.5-VL and Gemma 3 only yet, "
            f"not {model_type}"
        )
