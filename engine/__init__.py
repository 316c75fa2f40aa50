"""pagedserve's engine: paged KV cache, scheduler, model runner, offline LLM API."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
