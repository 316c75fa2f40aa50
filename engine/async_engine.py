"""Runs LLMEngine.step() on a background thread; asyncio callers add, abort and await outputs.

The server talks only to this facade, never to the LLMEngine inside, so the loop can move to
its own process later:

    model_name, model_dir, max_model_len, vocab_size, tokenizer     (read-only properties)
    make_request(id, prompt ids, params) -> Request   every refusal, once, before any response
    check_queue(num_new)                              the --max-num-queued-reqs bound (503)
    generate(request) -> async RequestOutput deltas   leaving early aborts the request
    abort(id), check_health() / is_alive              what /health and the lifecycle read
    kv_view                                           the KV map's snapshots (engine/core/)

Torch releases the GIL, so a long step never blocks the event loop.

Test-only fault injection: PAGEDSERVE_FAULT_INJECT=crash_after_steps:N makes the loop raise after
N steps, stall_after_steps:N makes it stop stepping (a hang), step_delay_ms:N slows every step;
read only by the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from pathlib import Path

from engine.core.kv_view import KVView
from engine.core.request import Request
from engine.executor.executor import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, StepStats
from engine.sampling_params import GrammarSpec, SamplingParams

logger = logging.getLogger(__name__)

FAULT_INJECT_ENV = "PAGEDSERVE_FAULT_INJECT"


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-num-queued-reqs; the caller should retry later."""


__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError"]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_stats: Callable[[StepStats], None] | None = None,
        max_num_queued_reqs: int | None = None,
    ) -> None:
        self.engine = engine  # the engine thread's; callers use the facade below
        self.on_stats = on_stats
        self.max_num_queued_reqs = max_num_queued_reqs
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        # Touched on every loop turn, idle or not: a stale value with work pending means a hang.
        self.last_progress_time = time.monotonic()
        # The playground's KV map: captures on this loop, only while someone subscribes.
        self.kv_view = KVView(engine.scheduler, wake=lambda: self._inbox.put(("wake", None)))

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the loop, then the model's worker processes (none outlive the server)."""
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        """The loop runs and no model worker has died (the executor's watcher tells at once)."""
        return self._thread.is_alive() and self.error is None and not self.engine.executor.dead

    @property
    def dead_worker(self) -> str | None:
        """Why the model's workers can run no more steps (one died), or None."""
        return self.engine.executor.dead

    def check_health(self) -> None:
        """EngineDeadError unless the loop runs (what /health and /ping answer from)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_worker or "the engine is not running")

    # ---- what the server may read --------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def lora_adapters(self) -> list:
        """The served LoRA adapters (engine/lora LoRARequest), in load order."""
        registry = self.engine.lora_registry
        return list(registry.adapters.values()) if registry is not None else []

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_registry is not None

    def load_lora(self, name: str, path: str, load_inplace: bool = False):
        """Reads, checks and registers an adapter (a LoRAError naming file and tensor); call it
        off the event loop. Running requests keep their adapter's weights."""
        return self.engine.lora_registry.load(name, path, load_inplace=load_inplace)

    def unload_lora(self, name: str):
        return self.engine.lora_registry.unload(name)

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def mm_processor(self):
        """Images in (engine/multimodal/processor.py), or None for a text-only model."""
        return self.engine.mm_processor

    @property
    def media_config(self):
        """The engine config, for its media limits (allowed_media_domains, ...)."""
        return self.engine.config

    @property
    def generation_defaults(self) -> dict:
        """Sampling defaults from the model's generation_config.json, for unset request fields."""
        return self.engine.generation_defaults

    @cached_property
    def tokenizer(self):
        """The caller's own copy: the engine thread decodes with the engine's, concurrently."""
        from transformers import AutoTokenizer

        from engine.startup_log import quiet_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.engine.model_dir)
        quiet_tokenizer(tokenizer)
        return tokenizer

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    @property
    def has_pending_work(self) -> bool:
        return bool(self._streams) or self._inbox.qsize() > 0

    def is_hung(self, stall_timeout: float) -> bool:
        """Work is pending and the loop has not come round for `stall_timeout` seconds."""
        stalled_for = time.monotonic() - self.last_progress_time
        return self.has_pending_work and stalled_for > stall_timeout

    def fail(self, error: EngineDeadError) -> None:
        """Declares the engine dead from outside (a hang): every waiter gets `error`."""
        if self.error is None:
            self.error = error
        self._fail_all(error)

    def fail_requests(self, error: EngineDeadError) -> None:
        """Ends every pending request with `error` (shutdown); the loop frees their blocks."""
        self._fail_all(error)

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
        """The request the engine will run, validated once (LLMEngine.make_request).

        EngineDeadError if the loop is gone; a ValueError naming the field for anything that
        can never run. Call check_queue for the batch first.
        """
        self.check_health()
        if request_id in self._streams:  # ids come partly from clients (X-Request-Id)
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.engine.make_request(
            request_id, prompt_token_ids, params, mm_inputs=mm_inputs, lora_name=lora_name,
            cache_salt=cache_salt,
        )

    def check_queue(self, num_new: int = 1) -> None:
        """QueueFullError if num_new more requests would pass --max-num-queued-reqs."""
        limit = self.max_num_queued_reqs
        if limit is not None and self.num_waiting + num_new > limit:
            raise QueueFullError(f"the server's waiting queue is full ({limit} requests)")

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yields per-step deltas of a request from make_request; leaving early aborts it."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        out_q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_q)
        self._inbox.put(("add", request))
        finished = False
        try:
            if self.error is not None:  # died between the check and registering the stream
                raise EngineDeadError("the engine is not running")
            while not finished:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compiles off both the event loop and the engine thread, within the time limit;
        GrammarError (HTTP 400) when the grammar is invalid, unsupported or too slow."""
        await self.engine.grammar_compiler.compile_async(spec)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ---- the loop (engine thread) ------------------------------------------------------------
    def _run(self) -> None:
        fault, fault_arg = _fault_plan(os.environ.get(FAULT_INJECT_ENV, ""))
        num_steps = 0
        try:
            while not self._stop.is_set():
                self.last_progress_time = time.monotonic()
                idle = not self.engine.has_unfinished_requests()
                self._drain(block=idle, timeout=self.kv_view.idle_timeout(0.5))
                if not self.engine.has_unfinished_requests():
                    self.kv_view.on_idle()
                else:
                    if fault == "delay":
                        time.sleep(fault_arg / 1000)
                    elif fault is not None and num_steps >= fault_arg:
                        self._inject(fault)
                        continue  # a stall returns only at shutdown
                    outputs, stats = self.engine.step()
                    num_steps += 1
                    self._dispatch(outputs)
                    if self.on_stats is not None:
                        self.on_stats(stats)
                    self.kv_view.on_step(stats.prefix_cache_queries, stats.prefix_cache_hits)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about the crash
            logger.exception("engine loop died")
            self.error = e
            self._fail_all(EngineDeadError(f"engine loop died: {e!r}"))

    def _drain(self, block: bool, timeout: float = 0.5) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        aborts = []
        while True:
            kind, payload = item
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                aborts.append(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        if aborts:
            self._dispatch(self.engine.abort_request(aborts))
            if self.on_stats is not None and not self.engine.has_unfinished_requests():
                self.on_stats(self.engine.snapshot_stats())

    def _add(self, req) -> None:
        """A request the engine refuses fails alone; it must never take the loop down."""
        try:
            self.engine.add(req)
        except ValueError as e:
            stream = self._streams.get(req.request_id)
            if stream is not None:
                loop, q = stream
                loop.call_soon_threadsafe(q.put_nowait, e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step, however many of its requests ran in it."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, q = stream
                deliveries.setdefault(loop, []).append((q, out))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, error: BaseException) -> None:
        for loop, q in list(self._streams.values()):
            # One instance per waiter: a raised exception carries its own traceback.
            loop.call_soon_threadsafe(q.put_nowait, type(error)(str(error)))

    def _inject(self, fault: str) -> None:
        if fault == "crash":
            raise RuntimeError(f"injected fault ({FAULT_INJECT_ENV})")
        logger.warning("injected stall (%s): the engine loop stops stepping", FAULT_INJECT_ENV)
        while not self._stop.is_set():
            time.sleep(0.05)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _fault_plan(spec: str) -> tuple[str | None, int]:
    """'crash_after_steps:N' -> ('crash', N), likewise stall and delay; anything else: no fault."""
    name, _, num = spec.partition(":")
    kinds = {"crash_after_steps": "crash", "stall_after_steps": "stall", "step_delay_ms": "delay"}
    if name not in kinds or not num.isdigit():
        if spec:
            logger.warning("ignoring unknown %s=%r", FAULT_INJECT_ENV, spec)
        return None, 0
    return kinds[name], int(num)
