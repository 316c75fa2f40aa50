"""Engine for pooling models (embeddings): `--runner pooling` / `--task embed`.

PoolingEngine (synchronous) reads the checkpoint, owns the tokenizer and a PoolingRunner, and
turns lists of prompts into vectors in batches under a token budget (shortest first, so a
padded encoder batch wastes little). AsyncPoolingEngine gives the server the same facade as
AsyncEngine (model_name, tokenizer, limits, health, shutdown) and one background thread that
folds every waiting request into the next batch, so concurrent requests share forwards.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.executor.executor import EngineDeadError
from engine.model_loader.loader import resolve_model
from engine.outputs import RequestMetrics, StepStats
from engine.runner.pooling_config import (
    POOLING_TASKS,
    is_pooling_checkpoint,
    read_pooling_config,
)
from engine.runner.pooling_runner import PoolingRunner, finish_embedding

logger = logging.getLogger(__name__)

# Per-batch token budget when the user gives none: pooling has no decode to keep fast, so
# batches are as large as memory comfortably allows (vLLM raises it for pooling models too).
POOLING_MAX_NUM_BATCHED_TOKENS = 16384


class PoolingEngine:
    runner_type = "pooling"

    def __init__(self, config: EngineConfig, hf_overrides: dict | None = None) -> None:
        if config.tensor_parallel_size > 1 or config.quantization:
            raise ValueError(
                "the pooling runner serves one rank with float weights: drop "
                "--tensor-parallel-size and --quantization for an embedding model"
            )
        self.model_dir = resolve_model(config.model)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        for key, value in (hf_overrides or {}).items():  # vLLM's --hf-overrides
            setattr(self.hf_config, key, value)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pooling = read_pooling_config(self.model_dir, self.hf_config)
        self.config = replace(config, max_model_len=self._max_model_len(config))
        self.model_name = config.served_model_name or (config.model or "").rstrip("/")
        self.runner = PoolingRunner(self.config, self.model_dir, self.hf_config, self.pooling)
        self.runner.classifier_token_ids = self._classifier_tokens()
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self.generation_defaults: dict = {}
        self.stats = PoolingStats()

    def _max_model_len(self, config: EngineConfig) -> int:
        return pooling_max_model_len(config, self.hf_config, self.pooling)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def backend_name(self) -> str:
        return self.runner.backend_name

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> list[torch.Tensor]:
        """One vector per prompt, in order: pooled, truncated to `dimensions`, normalised."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for batch in self._batches([prompts[i] for i in order], order):
            start = time.monotonic()
            pooled = self.runner.pool([prompts[i] for i in batch])
            for i, vec in zip(batch, pooled):
                out[i] = finish_embedding(vec, self.pooling.normalize, dimensions)
            self.stats.add(sum(len(prompts[i]) for i in batch), time.monotonic() - start)
        return out  # type: ignore[return-value]

    def score(self, prompts: list[list[int]], token_types: list[list[int]]) -> list[float]:
        """A cross-encoder's relevance score per (query, document) prompt, in order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[float] = [0.0] * len(prompts)
        for batch in self._batches([prompts[i] for i in order], order):
            start = time.monotonic()
            scores = self.runner.score([prompts[i] for i in batch], [token_types[i] for i in batch])
            for i, value in zip(batch, scores):
                out[i] = value
            self.stats.add(sum(len(prompts[i]) for i in batch), time.monotonic() - start)
        return out

    @property
    def is_cross_encoder(self) -> bool:
        return self.runner.cross_encoder

    def _classifier_tokens(self) -> tuple[int, int] | None:
        """classifier_from_token ["no", "yes"] as token ids; ValueError unless each is one."""
        tokens = getattr(self.hf_config, "classifier_from_token", None)
        if not tokens:
            return None
        if len(tokens) != 2:
            raise ValueError('classifier_from_token must name two tokens, e.g. ["no", "yes"]')
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in tokens]
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise ValueError(f"classifier_from_token {tokens}: not tokens of this vocabulary")
        return ids[0], ids[1]

    def _batches(self, ordered: list[list[int]], order: list[int]):
        """Index lists under the token budget (padded length x rows) and max_num_seqs."""
        batch: list[int] = []
        for prompt, i in zip(ordered, order):
            padded = len(prompt) * (len(batch) + 1)  # ascending: this prompt is the longest
            if batch and (padded > self.max_num_batched_tokens or len(batch) >= self._max_seqs):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    @property
    def _max_seqs(self) -> int:
        return self.config.max_num_seqs

    def shutdown(self) -> None:
        """Nothing runs in other processes."""


def pooling_max_model_len(config: EngineConfig, hf_config, pooling) -> int:
    """The user's limit, else sentence-transformers' max_seq_length, else the model's."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 512
    limit = pooling.max_seq_length or model_max
    if config.max_model_len is None:
        return min(limit, model_max)
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit {model_max}"
        )
    return config.max_model_len


def wants_pooling(
    model: str | None, runner: str = "auto", task: str = "auto", hf_overrides: dict | None = None
) -> bool:
    """vLLM's --runner / --task: explicit, or (auto) from the checkpoint: a sentence-
    transformers folder (modules.json) or an encoder / bare backbone architecture."""
    if runner != "auto":
        return runner == "pooling"
    if task != "auto":
        return task in POOLING_TASKS
    model_dir = resolve_model(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    for key, value in (hf_overrides or {}).items():
        setattr(hf_config, key, value)
    return is_pooling_checkpoint(model_dir, hf_config)


@dataclass
class PoolingStats:
    """Totals since start (read by the server's metrics)."""

    num_batches: int = 0
    num_prompt_tokens: int = 0
    busy_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, num_tokens: int, seconds: float) -> None:
        with self.lock:
            self.num_batches += 1
            self.num_prompt_tokens += num_tokens
            self.busy_s += seconds


@dataclass
class _Job:
    prompts: list[list[int]]
    dimensions: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    token_types: list[list[int]] | None = None  # set: a cross-encoder score job
    arrival_time: float = field(default_factory=time.monotonic)


class AsyncPoolingEngine:
    """The server's facade over a PoolingEngine: `await embed(prompts, dimensions)`."""

    runner_type = "pooling"
    kv_view = None

    def __init__(self, engine: PoolingEngine, on_stats: Callable[[StepStats], None] | None = None):
        self.engine = engine
        self.on_stats = on_stats  # the server's metrics: one StepStats per served round
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pooling-loop", daemon=True)
        self.error: BaseException | None = None
        self.last_progress_time = time.monotonic()
        self._pending = 0

    # ---- what the server reads ---------------------------------------------------------------
    model_name = property(lambda self: self.engine.model_name)
    model_dir = property(lambda self: self.engine.model_dir)
    max_model_len = property(lambda self: self.engine.max_model_len)
    vocab_size = property(lambda self: self.engine.vocab_size)
    tokenizer = property(lambda self: self.engine.tokenizer)
    generation_defaults = property(lambda self: {})
    pooling = property(lambda self: self.engine.pooling)
    hidden_size = property(lambda self: self.engine.runner.hidden_size)
    is_cross_encoder = property(lambda self: self.engine.is_cross_encoder)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check_health(self) -> None:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")

    def is_hung(self, stall_timeout: float) -> bool:
        stalled = time.monotonic() - self.last_progress_time > stall_timeout
        return self._pending > 0 and stalled

    def fail(self, error: EngineDeadError) -> None:
        if self.error is None:
            self.error = error
        self.fail_requests(error)

    def fail_requests(self, error: EngineDeadError) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _resolve(job, error=error)

    # ---- requests ----------------------------------------------------------------------------
    async def embed(
        self, prompts: list[list[int]], dimensions: int | None = None
    ) -> list[torch.Tensor]:
        return await self._submit(prompts, dimensions, None)

    async def score(self, prompts: list[list[int]], token_types: list[list[int]]) -> list[float]:
        """Cross-encoder scores of (query, document) prompts with their token type ids."""
        return await self._submit(prompts, None, token_types)

    async def _submit(self, prompts, dimensions, token_types):
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        loop = asyncio.get_running_loop()
        job = _Job(prompts, dimensions, loop, loop.create_future(), token_types)
        self._pending += 1
        self._inbox.put(job)
        try:
            return await job.future
        finally:
            self._pending -= 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._inbox.get(timeout=1.0)
            except queue.Empty:
                self.last_progress_time = time.monotonic()
                continue
            jobs = [first] if first is not None else []
            while True:  # every job waiting now joins this round
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs.append(job)
            self._serve(jobs)
            self.last_progress_time = time.monotonic()

    def _serve(self, jobs: list[_Job]) -> None:
        """Jobs of one kind (embed with one `dimensions`, or score) run as one call."""
        by_kind: dict[tuple, list[_Job]] = {}
        for job in jobs:
            by_kind.setdefault((job.token_types is None, job.dimensions), []).append(job)
        for (embed, dims), group in by_kind.items():
            started = time.monotonic()
            prompts = [p for j in group for p in j.prompts]
            try:
                if embed:
                    vecs = self.engine.embed(prompts, dims)
                else:
                    vecs = self.engine.score(prompts, [t for j in group for t in j.token_types])
            except Exception as e:  # noqa: BLE001 - the request gets it; the loop keeps serving
                logger.exception("pooling batch failed")
                for job in group:
                    _resolve(job, error=e)
                continue
            at = 0
            for job in group:
                _resolve(job, result=vecs[at : at + len(job.prompts)])
                at += len(job.prompts)
            self._report(group, started)

    def _report(self, group: list[_Job], started: float) -> None:
        """Prompt tokens and one finished request per job, for /metrics (vLLM's names)."""
        if self.on_stats is None:
            return
        now = time.monotonic()
        done = [
            RequestMetrics(j.arrival_time, started, None, now, sum(map(len, j.prompts)), 0, 0)
            for j in group
        ]
        tokens = sum(m.num_prompt_tokens for m in done)
        self.on_stats(
            StepStats(
                num_running=len(group),
                num_scheduled_tokens=tokens,
                num_prompt_tokens=tokens,
                step_time=now - started,
                finished=done,
                finished_reasons=["stop"] * len(done),
            )
        )


def _resolve(job: _Job, result=None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    job.loop.call_soon_threadsafe(settle)
