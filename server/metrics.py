"""Prometheus metrics, named like vLLM's with the pagedserve: prefix, fed from StepStats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.outputs import StepStats

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

P = "pagedserve:"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(P + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(P + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(P + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.free_blocks = gauge("kv_cache_free_blocks", "KV blocks with no holder.")
        self.cached_blocks = gauge(
            "kv_cache_cached_blocks", "Free KV blocks still holding a cached prefix."
        )
        self.used_blocks = gauge("kv_cache_used_blocks", "KV blocks held by requests.")
        self.total_blocks = gauge("kv_cache_total_blocks", "All KV blocks in the pool.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.request_success = Counter(
            P + "request_success",
            "Finished requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency.", LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time spent waiting.", LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS
        )

    def observe(self, s: StepStats) -> None:
        """Called once per engine step from the engine thread; prometheus_client is thread-safe."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.free_blocks.set(s.num_free_blocks)
        self.cached_blocks.set(s.num_cached_free_blocks)
        self.used_blocks.set(s.num_total_blocks - s.num_free_blocks)
        self.total_blocks.set(s.num_total_blocks)
        self.preemptions.inc(s.num_preemptions)
        self.prompt_tokens.inc(s.num_prompt_tokens)
        self.generation_tokens.inc(s.num_generation_tokens)
        self.prefix_queries.inc(s.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits)
        if s.num_scheduled_tokens:
            self.iteration_tokens.observe(s.num_scheduled_tokens)
        for itl in s.inter_token_latencies:
            self.itl.observe(itl)
        for m, reason in zip(s.finished, s.finished_reasons):
            self.request_success.labels(self.model_name, reason).inc()
            self.e2e.observe(m.e2e_latency)
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
