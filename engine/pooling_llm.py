"""Causal (decoder) embedders on the shared scheduler: vLLM V1's pooling requests.

A Qwen3-Embedding-shaped model is served by the ordinary LLMEngine with a PoolingModelRunner
(engine/runner/pooling_hook.py): each prompt becomes a Request carrying PoolingParams
(engine/core/pooling.py), scheduled like any prefill under --max-num-batched-tokens (chunked
across steps when long, prefix-cached for last-token pooling), and finished with its pooled
vector when its last chunk has run. Encoders (BERT), cross-encoders and decoder rerankers
(classifier_from_token) keep the pooling engine's own loop (engine/pooling_engine.py).

    build_pooling_llm_engine(config) -> LLMEngine     the engine, .pooling set
    AsyncPoolingLLMEngine(engine, on_stats)           the server's facade: await embed(...)
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import torch
from transformers import AutoConfig

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.pooling import PoolingParams
from engine.core.request import Request, RequestRejectedError
from engine.llm_engine import LLMEngine
from engine.model_loader.loader import resolve_model
from engine.models import MODEL_REGISTRY
from engine.pooling_engine import pooling_max_model_len
from engine.runner.pooling_config import is_cross_encoder, is_encoder, read_pooling_config
from engine.runner.pooling_runner import decoder_architecture, finish_embedding
from engine.sampling_params import SamplingParams

_POOLING_SAMPLING = SamplingParams(max_tokens=1)  # never read: pooling requests sample nothing
_ids = itertools.count()


def pools_on_scheduler(model: str | None, hf_overrides: dict | None = None) -> bool:
    """A decoder embedder this engine runs (not an encoder, cross-encoder or reranker)."""
    if hf_overrides:  # classifier_from_token and friends: the pooling engine applies them
        return False
    hf_config = AutoConfig.from_pretrained(resolve_model(model))
    if is_encoder(hf_config) or is_cross_encoder(hf_config):
        return False
    return decoder_architecture(hf_config) in MODEL_REGISTRY


def build_pooling_llm_engine(config: EngineConfig) -> LLMEngine:
    """An LLMEngine whose runner pools: the checkpoint's pooling, its max_seq_length."""
    if config.tensor_parallel_size > 1 or config.quantization:
        raise ValueError(
            "the pooling runner serves one rank with float weights: drop "
            "--tensor-parallel-size and --quantization for an embedding model"
        )
    model_dir = resolve_model(config.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    pooling = read_pooling_config(model_dir, hf_config)
    max_len = pooling_max_model_len(config, hf_config, pooling)
    engine = LLMEngine(
        replace(config, runner="pooling", max_model_len=max_len, distributed_executor_backend="uni")
    )
    engine.pooling = pooling
    return engine


def make_pooling_request(
    engine: LLMEngine, request_id: str, prompt_token_ids: list[int], pooling_type: str
) -> Request:
    """A validated pooling request (RequestRejectedError naming `input` otherwise)."""
    vocab = engine.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestRejectedError(
            f"token id {bad} is out of the vocabulary (size {vocab})", "input"
        )
    req = Request(request_id, prompt_token_ids, _POOLING_SAMPLING)
    req.pooling_params = PoolingParams(pooling_type)
    engine.scheduler.check_fits(req)
    return req


class AsyncPoolingLLMEngine(AsyncEngine):
    """AsyncEngine (one loop, the shared scheduler, metrics per step) serving embeddings."""

    runner_type = "pooling"
    is_cross_encoder = False

    @property
    def pooling(self):
        return self.engine.pooling

    @property
    def hidden_size(self) -> int:
        return self.engine.text_config.hidden_size

    async def embed(
        self, prompts: list[list[int]], dimensions: int | None = None
    ) -> list[torch.Tensor]:
        """One vector per prompt, in order: each prompt its own request (as vLLM), pooled,
        truncated to `dimensions` and normalised as the model says."""
        self.check_health()
        self.check_queue(len(prompts))  # --max-num-queued-reqs (QueueFullError: 503)
        kind = self.pooling.pooling_type
        base = f"embd-{next(_ids)}"
        reqs = [
            make_pooling_request(self.engine, f"{base}-{i}", p, kind) for i, p in enumerate(prompts)
        ]
        vecs = await asyncio.gather(*(self._pool(r) for r in reqs))
        return [finish_embedding(v, self.pooling.normalize, dimensions) for v in vecs]

    async def _pool(self, request: Request) -> torch.Tensor:
        last = None
        async for out in self.generate(request):
            last = out
        return last.pooled_output
