"""What the engine hands out: per-request outputs and one stats object per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, if asked for
    cumulative_logprob: float | None = None  # beam search: the sum of the tokens' logprobs


@dataclass
class RequestOutput:
    """From LLMEngine.step() outputs[0] holds only this step's delta; LLM.generate accumulates."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first entry None, if asked for
    metrics: RequestMetrics | None = None  # set once, when finished
    pooled_output: object | None = None  # a pooling request's vector (torch), when finished


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    request_id: str = ""  # for the per-request log line written from the stats path

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs computed in one step: entries for prompt positions start, start + 1, ..."""

    start: int  # prompt position of entries[0] (>= 1: position 0 has no logprob)
    entries: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, parallel to SchedulerOutput.requests."""

    sampled_token_ids: list[int | None]  # None: a partial prefill chunk sampled nothing
    # request id -> the sampled token's logprobs (only requests with params.logprobs set)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> prompt logprobs of the rows computed this step (params.prompt_logprobs set)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Requests that ran drafts (speculative decoding): request id -> every token emitted this
    # step (accepted drafts, then the bonus token, which sampled_token_ids also holds), and
    # their logprobs, one per token, for requests with params.logprobs set.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # pooling requests whose last prompt chunk ran: request id -> pooled float32 CPU vector
    pooler_output: dict[str, object] = field(default_factory=dict)
    # the KV tier under tensor parallelism: every rank's news this step (kv_offload/tp_worker.py)
    kv_tier_reports: list[dict] | None = None


@dataclass
class StepStats:
    """Everything the metrics layer needs from one engine step (the engine imports no metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill work)
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # of which found cached
    # images this step (engine/multimodal/embedder.py): encoder-cache lookups, hits, encoded
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    mm_images_encoded: int = 0
    kv_cache_usage: float = 0.0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_free_blocks: int = 0
    step_time: float = 0.0
    # speculative decoding this step (vLLM's spec_decode_* counters)
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    finished: list[RequestMetrics] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    # with --enable-lora: (max_loras, running adapters, waiting adapters), names comma-joined
    # (vLLM's vllm:lora_requests_info labels); None without LoRA
    lora_info: tuple[int, str, str] | None = None
