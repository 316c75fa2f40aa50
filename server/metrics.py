"""Prometheus metrics under vLLM's exact names (`vllm:`), fed from StepStats.

Names, meanings, label (`model_name`) and bucket boundaries follow vLLM's V1 Prometheus logger,
so routers, autoscalers and dashboards that read a vLLM server (llm-d's endpoint picker, KEDA,
vLLM's Grafana dashboard) read ours unchanged. What vLLM has no name for keeps the `pagedserve:`
prefix (the kv_cache_*_blocks gauges, the connection guard's series). Finished requests also
get one structured log line each (logger `pagedserve.requests`).
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestMetrics, StepStats
from server.kv_memory_metrics import KVMemoryCollector

request_logger = logging.getLogger("pagedserve.requests")

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISHED_REASONS = ("stop", "length", "abort")  # pre-created so rate() sees them from zero

V = "vllm:"  # vLLM's names and meanings
P = "pagedserve:"  # ours, where vLLM has no name
OWN_NAMES = frozenset(
    f"kv_cache_{kind}_blocks" for kind in ("free", "cached", "used", "total")
) | {
    "http_connections_open",
    "http_slow_clients_closed",
    "http_connections_rejected",
    "mm_encoder_images",  # vLLM counts encoder-cache queries and hits, not images encoded
    # the KV memory model (server/kv_memory_metrics.py)
    "forks",
    "kv_cow_copies",
    "kv_tier_usage_bytes",
    "kv_tier_capacity_bytes",
    "kv_tier_blocks",
    "kv_tier_corrupt_files",
    "kv_swap_out_blocks",
    "kv_swap_in_blocks",
    "kv_swap_preemptions",
    "kv_swapped_requests",
}


def metric_name(name: str) -> str:
    """The full exposed name of a family: vllm:NAME, or pagedserve:NAME for our own."""
    return (P if name in OWN_NAMES else V) + name


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        disable_created_metrics()  # like vLLM: no *_created series (process-wide switch)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._add_scheduler_gauges()
        self._add_counters()
        self._add_histograms(build_1_2_5_buckets(max_model_len))
        # what observe() feeds from each step, in its order, and the values the gauges hold
        self._gauges = (
            self.running, self.waiting, self.kv_usage, self.free_blocks, self.cached_blocks,
            self.used_blocks, self.total_blocks,
        )
        self._gauge_values: tuple = (None,) * len(self._gauges)
        self._lora_gauge = self._lora_info = None  # created on the first LoRA engine step
        self._counters = (
            self.preemptions, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
            self.prefix_hits, self.mm_queries, self.mm_hits, self.mm_encoded,
        )

    # ---- families ----------------------------------------------------------------------------
    def _gauge(self, name: str, doc: str):
        family = Gauge(metric_name(name), doc, ["model_name"], registry=self.registry)
        return family.labels(self.model_name)

    def _counter(self, name: str, doc: str):
        family = Counter(metric_name(name), doc, ["model_name"], registry=self.registry)
        return family.labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: list[float]):
        family = Histogram(
            metric_name(name), doc, ["model_name"], buckets=buckets, registry=self.registry
        )
        return family.labels(self.model_name)

    def _add_scheduler_gauges(self) -> None:
        self.running = self._gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.free_blocks = self._gauge(
            "kv_cache_free_blocks", "KV blocks no request holds (cached ones included)."
        )
        self.cached_blocks = self._gauge(
            "kv_cache_cached_blocks", "Free KV blocks still holding a cached prefix."
        )
        self.used_blocks = self._gauge("kv_cache_used_blocks", "KV blocks held by requests.")
        self.total_blocks = self._gauge("kv_cache_total_blocks", "All KV blocks in the pool.")

    def _add_counters(self) -> None:
        c = self._counter
        self.preemptions = c("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = c("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = c("prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = c("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.mm_queries = c("mm_cache_queries", "Encoder-cache lookups, in images.")
        self.mm_hits = c("mm_cache_hits", "Encoder-cache hits, in images.")
        self.mm_encoded = c("mm_encoder_images", "Images run through the vision encoder.")
        self.request_success = Counter(
            V + "request_success",
            "Count of finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISHED_REASONS:
            self.request_success.labels(self.model_name, reason)
        self.spec_drafts = c("spec_decode_num_drafts", "Requests that ran draft tokens, per step.")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = c(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."
        )
        self.spec_accepted_per_pos = Counter(
            V + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 is the first).",
            ["model_name", "position"],
            registry=self.registry,
        )

    def _add_histograms(self, token_buckets: list[int]) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = h(
            "request_time_per_output_token_seconds",
            "Mean time per output token of each request, after the first.",
            ITL_BUCKETS,
        )
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = h(
            "request_queue_time_seconds", "Time spent in the WAITING phase.", LATENCY_BUCKETS
        )
        self.inference_time = h(
            "request_inference_time_seconds", "Time from first schedule to finish.", LATENCY_BUCKETS
        )
        self.prefill_time = h(
            "request_prefill_time_seconds", "First schedule to first token.", LATENCY_BUCKETS
        )
        self.decode_time = h(
            "request_decode_time_seconds", "Time from first token to finish.", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = h(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self.request_generation_tokens = h(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        self.iteration_tokens = h(
            "iteration_tokens_total", "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS
        )

    # ---- feeding -----------------------------------------------------------------------------
    def observe(self, s: StepStats) -> None:
        """Called once per engine step from the engine thread; prometheus_client is thread-safe.
        A gauge is set when its value changed and a counter moved when it grew: a decode step
        at one request changes few of them (each call takes a lock)."""
        gauges = (
            s.num_running, s.num_waiting, s.kv_cache_usage, s.num_free_blocks,
            s.num_cached_free_blocks, s.num_total_blocks - s.num_free_blocks, s.num_total_blocks,
        )
        for gauge, value, last in zip(self._gauges, gauges, self._gauge_values):
            if value != last:
                gauge.set(value)
        self._gauge_values = gauges
        counts = (
            s.num_preemptions, s.num_prompt_tokens, s.num_generation_tokens,
            s.prefix_cache_queries, s.prefix_cache_hits, s.mm_cache_queries, s.mm_cache_hits,
            s.mm_images_encoded,
        )
        for counter, n in zip(self._counters, counts):
            if n:
                counter.inc(n)
        if s.num_scheduled_tokens:
            self.iteration_tokens.observe(s.num_scheduled_tokens)
        if s.num_spec_drafts:
            self._observe_spec(s)
        if s.lora_info is not None and s.lora_info != self._lora_info:
            self._observe_lora(s.lora_info)
        for itl in s.inter_token_latencies:
            self.itl.observe(itl)
        for m, reason in zip(s.finished, s.finished_reasons):
            self.observe_finished(m, reason)

    def _observe_lora(self, info: tuple[int, str, str]) -> None:
        """vLLM's vllm:lora_requests_info: one series, labels the adapters running and waiting,
        value the time they were seen (llm-d's LoRA-affinity routing reads it)."""
        if self._lora_gauge is None:
            labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
            doc = "Running stats on lora requests."
            self._lora_gauge = Gauge(V + "lora_requests_info", doc, labels, registry=self.registry)
        self._lora_gauge.clear()
        self._lora_gauge.labels(str(info[0]), info[1], info[2]).set_to_current_time()
        self._lora_info = info

    def _observe_spec(self, s: StepStats) -> None:
        self.spec_drafts.inc(s.num_spec_drafts)
        self.spec_draft_tokens.inc(s.num_spec_draft_tokens)
        self.spec_accepted_tokens.inc(s.num_spec_accepted_tokens)
        for pos, n in enumerate(s.num_spec_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(n)

    def observe_finished(self, m: RequestMetrics, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(m.e2e_latency)
        self.request_prompt_tokens.observe(m.num_prompt_tokens)
        self.request_generation_tokens.observe(m.num_generation_tokens)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
            self.inference_time.observe(m.finished_time - m.first_scheduled_time)
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
            decode_time = m.finished_time - m.first_token_time
            self.decode_time.observe(decode_time)
            if m.num_generation_tokens > 1:
                self.tpot.observe(decode_time / (m.num_generation_tokens - 1))
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        log_finished_request(m, reason)

    def cache_config_info(self, block_size: int, num_gpu_blocks: int, **extra) -> None:
        """vllm:cache_config_info: an info gauge held at 1 whose labels carry the cache config
        (the endpoint picker reads block_size and num_gpu_blocks from it)."""
        labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)}
        labels |= {k: str(v) for k, v in extra.items()}
        labels["engine"] = "0"
        info = Gauge(
            V + "cache_config_info", "Information of the LLMEngine CacheConfig",
            list(labels), registry=self.registry,
        )
        info.labels(**labels).set(1)

    def watch_kv_memory(self, engine) -> None:
        """Forks, copy-on-write copies and the KV tier (server/kv_memory_metrics.py)."""
        self.registry.register(KVMemoryCollector(engine, self.model_name))

    def watch_connections(self, stats) -> None:
        """Exposes a server/connection_guard.ConnectionStats, read at scrape time."""
        self.registry.register(_ConnectionCollector(stats, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ConnectionCollector:
    """The connection guard's plain counters as Prometheus families (no locks on its path)."""

    def __init__(self, stats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self):
        name = self.model_name
        open_ = GaugeMetricFamily(
            P + "http_connections_open", "Open HTTP connections.", labels=["model_name"]
        )
        open_.add_metric([name], self.stats.num_open)
        slow = CounterMetricFamily(
            P + "http_slow_clients_closed",
            "Connections closed for missing a header or body deadline (idle: no byte at all).",
            labels=["model_name", "phase"],
        )
        for phase, count in self.stats.slow_clients_closed.items():
            slow.add_metric([name, phase], count)
        rejected = CounterMetricFamily(
            P + "http_connections_rejected",
            "Connections or requests refused with 503 at --limit-connections/--limit-concurrency.",
            labels=["model_name", "reason"],
        )
        for reason, count in self.stats.rejected.items():
            rejected.add_metric([name, reason], count)
        return [open_, slow, rejected]


def log_finished_request(m: RequestMetrics, reason: str) -> None:
    """One logfmt line per finished request: greppable by request_id, parseable by Loki & co."""
    request_logger.info(
        "request finished request_id=%s finish_reason=%s prompt_tokens=%d generation_tokens=%d "
        "ttft_s=%s e2e_s=%.4f queue_s=%s preemptions=%d",
        m.request_id or "-",
        reason,
        m.num_prompt_tokens,
        m.num_generation_tokens,
        _seconds(m.time_to_first_token),
        m.e2e_latency,
        _seconds(m.queue_time),
        m.num_preemptions,
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
