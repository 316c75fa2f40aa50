"""A real Prometheus scrapes a live pagedserve under load; plus exposition lint, logs, request ids.

The server gets a tiny KV pool (so requests preempt each other) and prefix caching with a shared
prompt prefix (so the cache hits). Debian's `prometheus` package provides both `prometheus` and
`promtool`; .ci/run installs it. Where it is missing the Prometheus tests skip with a loud
warning and the prometheus_client-parser checks below still run.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess, free_port, metric_value

from server.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, metric_name

# A request is ~19 prompt + 12 generated tokens = 8 blocks: 3 prompts fit, then growth preempts.
NUM_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, CONCURRENCY = 16, 4, 8, 6
MAX_TOKENS = 12
SHARED_PREFIX = "Answer tersely: "  # 16 bytes (byte tokenizer) = 4 full blocks to share
LABELS = {"model_name": "tiny"}

# promtool's lint rules that our names break on purpose (DESIGN.md's metric contract copies
# vLLM's names): ':' is reserved for recording rules by convention, and vLLM calls a histogram
# iteration_tokens_total. Anything else promtool reports fails the test.
ACCEPTED_PROMTOOL_FINDINGS = [
    re.compile(r"^(pagedserve|vllm):\w+ metric names should not contain ':'$"),
    re.compile(
        r'^vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$'
    ),
]


class PrometheusMissingWarning(UserWarning):
    pass


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        msg = (
            f"`{binary}` is not installed (Debian package `prometheus`: apt-get install -y "
            "prometheus); the real-Prometheus check did NOT run"
        )
        warnings.warn(msg, PrometheusMissingWarning, stacklevel=2)
        print(f"\n!!! {msg} !!!")
        pytest.skip(msg)
    return path


# ---- the load ----------------------------------------------------------------------------------
def _complete(url: str, prompt: str, results: list, headers: dict | None = None) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    results.append(r)


def run_load(
    url: str, min_seconds: float = 2.0, max_waves: int = 8, concurrency: int = CONCURRENCY
) -> list[httpx.Response]:
    """Waves of concurrent requests sharing a prefix: two at least, for at least min_seconds."""
    results: list[httpx.Response] = []
    start, wave = time.monotonic(), 0
    while wave < min(2, max_waves) or (time.monotonic() - start < min_seconds and wave < max_waves):
        threads = [
            threading.Thread(target=_complete, args=(url, f"{SHARED_PREFIX}{wave}-{i}", results))
            for i in range(concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wave += 1
    return results


@pytest.fixture(scope="module")
def loaded_server(tiny_model_dir):
    server = ServerProcess(
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--enable-prefix-caching",
        # Slow every step so queue states outlast several 250 ms scrapes on a fast machine too.
        env={"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:40"},
    ).wait_ready()
    yield server
    server.stop()


# ---- a real Prometheus -------------------------------------------------------------------------
class PrometheusProcess:
    """`prometheus` on a loopback port scraping one target every 250 ms."""

    def __init__(self, binary: str, target: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n"
            "scrape_configs:\n  - job_name: pagedserve\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> PrometheusProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()[-3000:]}")

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(
            self.url + "/api/v1/query", params={"query": promql}, timeout=10, trust_env=False
        )
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, f"{promql} -> {result}"
        return float(result[0]["value"][1])

    def wait_for(self, promql: str, predicate, timeout: float = 60.0) -> float:
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            result = self.query(promql)
            if len(result) == 1:
                value = float(result[0]["value"][1])
                if predicate(value):
                    return value
            time.sleep(0.25)
        raise AssertionError(f"{promql} never satisfied the check (last value {value})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _served_so_far(url: str) -> tuple[float, float]:
    """(finished requests, their prompt tokens) before this load: other tests share the server."""
    text = httpx.get(url + "/metrics", timeout=10).text
    num = sum(
        metric_value(text, "vllm:request_success_total", {"finished_reason": reason})
        for reason in ("stop", "length", "abort")
    )
    return num, metric_value(text, "vllm:request_prompt_tokens_sum")


@pytest.fixture(scope="module")
def scraped(loaded_server, tmp_path_factory):
    """Prometheus scrapes while the load runs; yields (prometheus, requests, prompt tokens)."""
    binary = _require("prometheus")
    target = f"127.0.0.1:{loaded_server.port}"
    prom = PrometheusProcess(binary, target, tmp_path_factory.mktemp("prometheus")).wait_ready()
    try:
        prom.wait_for('up{job="pagedserve"}', lambda v: v == 1)
        num_before, prompt_before = _served_so_far(loaded_server.url)
        results = run_load(loaded_server.url)
        assert all(r.status_code == 200 for r in results), [r.text for r in results][:3]
        num_requests = num_before + len(results)
        prompt_tokens = prompt_before + sum(r.json()["usage"]["prompt_tokens"] for r in results)
        # Quiet again and every finished request scraped: the later checks see the final state.
        prom.wait_for("sum(vllm:request_success_total)", lambda v: v >= num_requests)
        prom.wait_for("vllm:num_requests_running", lambda v: v == 0)
        yield prom, num_requests, prompt_tokens
    finally:
        prom.stop()


def test_prometheus_sees_running_and_waiting(scraped):
    prom = scraped[0]
    running = prom.scalar('max_over_time(vllm:num_requests_running{model_name="tiny"}[5m])')
    waiting = prom.scalar('max_over_time(vllm:num_requests_waiting{model_name="tiny"}[5m])')
    assert 1 <= running <= CONCURRENCY
    assert 1 <= waiting <= CONCURRENCY  # the pool holds fewer requests than are sent at once
    assert prom.scalar("vllm:num_requests_waiting") == 0


def test_prometheus_sees_kv_usage_and_blocks(scraped):
    prom = scraped[0]
    peak = prom.scalar("max_over_time(vllm:kv_cache_usage_perc[5m])")
    assert 0.5 < peak <= 1.0  # the tiny pool was driven near full
    assert prom.scalar("vllm:kv_cache_usage_perc") == 0  # idle: cached blocks count free
    assert prom.scalar("pagedserve:kv_cache_total_blocks") == NUM_BLOCKS
    free_plus_used = prom.scalar(
        "pagedserve:kv_cache_free_blocks + pagedserve:kv_cache_used_blocks"
    )
    assert free_plus_used == NUM_BLOCKS
    cached = prom.scalar("pagedserve:kv_cache_cached_blocks")
    assert 0 < cached <= prom.scalar("pagedserve:kv_cache_free_blocks")


def test_prometheus_sees_preemptions_and_prefix_hits(scraped):
    prom = scraped[0]
    assert prom.scalar("vllm:num_preemptions_total") > 0
    hits = prom.scalar("vllm:prefix_cache_hits_total")
    queries = prom.scalar("vllm:prefix_cache_queries_total")
    assert 0 < hits < queries


def test_prometheus_sees_tokens_and_successes(scraped):
    prom, num_requests, prompt_tokens = scraped
    reasons = prom.query("vllm:request_success_total")
    by_reason = {r["metric"]["finished_reason"]: float(r["value"][1]) for r in reasons}
    assert by_reason == {"stop": 0, "length": num_requests, "abort": 0}
    assert prom.scalar("vllm:generation_tokens_total") == num_requests * MAX_TOKENS
    assert prom.scalar("vllm:request_generation_tokens_sum") == num_requests * MAX_TOKENS
    assert prom.scalar("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert prom.scalar("vllm:prompt_tokens_total") > 0


def test_prometheus_ttft_histogram_is_sane(scraped):
    prom, num_requests, _ = scraped
    buckets = prom.query('vllm:time_to_first_token_seconds_bucket{model_name="tiny"}')
    by_le = {r["metric"]["le"]: float(r["value"][1]) for r in buckets}
    assert sorted(float(le) for le in by_le) == sorted([*TTFT_BUCKETS, math.inf])
    counts = [by_le[le] for le in sorted(by_le, key=float)]
    assert counts == sorted(counts), "cumulative buckets must not decrease"
    assert by_le["+Inf"] == num_requests
    assert prom.scalar("vllm:time_to_first_token_seconds_count") == num_requests
    p50 = prom.scalar(
        "histogram_quantile(0.5, sum by (le) (vllm:time_to_first_token_seconds_bucket))"
    )
    p99_e2e = prom.scalar(
        "histogram_quantile(0.99, sum by (le) (vllm:e2e_request_latency_seconds_bucket))"
    )
    assert 0 < p50 < 120 and 0 < p99_e2e < 7680
    mean_ttft = prom.scalar(
        "vllm:time_to_first_token_seconds_sum / vllm:time_to_first_token_seconds_count"
    )
    mean_e2e = prom.scalar(
        "vllm:e2e_request_latency_seconds_sum / vllm:e2e_request_latency_seconds_count"
    )
    assert 0 < mean_ttft < mean_e2e
    itl_count = prom.scalar("vllm:inter_token_latency_seconds_count")
    assert itl_count == num_requests * (MAX_TOKENS - 1)


def test_every_dashboard_query_returns_data(scraped):
    """deploy/grafana/pagedserve.json works against a real Prometheus scraping a real server."""
    from test_deploy import concrete_promql, dashboard_exprs

    prom = scraped[0]
    for expr in dashboard_exprs():
        if expr.startswith("label_values("):
            continue
        promql = concrete_promql(expr).replace("[1m]", "[5m]")
        assert prom.query(promql), f"no data for {expr}"


# ---- the exposition itself ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def exposition(loaded_server) -> str:
    run_load(loaded_server.url, min_seconds=0, max_waves=1, concurrency=2)
    return httpx.get(loaded_server.url + "/metrics", timeout=10).text


def test_promtool_check_metrics_passes(exposition):
    promtool = _require("promtool")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr  # 1: the text does not parse
    findings = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    unexpected = [f for f in findings if not any(p.match(f) for p in ACCEPTED_PROMTOOL_FINDINGS)]
    assert not unexpected, unexpected


def test_promtool_rejects_a_broken_exposition():
    """The check above is only worth something if promtool does fail on bad text."""
    promtool = _require("promtool")
    bad = 'pagedserve_x{model_name="tiny" 1\n'
    proc = subprocess.run([promtool, "check", "metrics"], input=bad, capture_output=True, text=True)
    assert proc.returncode == 1


PREFIXES = ("vllm:", "pagedserve:")
EXPECTED_FAMILIES = {
    "cache_config_info": "gauge",  # labels block_size, num_gpu_blocks (the endpoint picker's)
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "kv_cache_free_blocks": "gauge",
    "kv_cache_cached_blocks": "gauge",
    "kv_cache_used_blocks": "gauge",
    "kv_cache_total_blocks": "gauge",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    # images (engine/multimodal/embedder.py; zero for a text-only model)
    "mm_cache_queries": "counter",
    "mm_cache_hits": "counter",
    "mm_encoder_images": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram",
    # n-gram speculative decoding (vLLM's names; zero without --speculative-config)
    "spec_decode_num_drafts": "counter",
    "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
    # connection guard (server/connection_guard.py): our own, beside vLLM's names
    "http_connections_open": "gauge",
    "http_slow_clients_closed": "counter",
    "http_connections_rejected": "counter",
    # forks and copy-on-write copies (server/kv_memory_metrics.py); the KV tier's series appear
    # only with --kv-offloading-size (tests/test_kv_offload.py)
    "forks": "counter",
    "kv_cow_copies": "counter",
}
VLLM_BUCKETS = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": ITL_BUCKETS,
    "e2e_request_latency_seconds": LATENCY_BUCKETS,
    "request_queue_time_seconds": LATENCY_BUCKETS,
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}


def test_exposition_parses_with_vllm_names_types_and_buckets(exposition):
    """promtool-equivalent checks with prometheus_client's parser (run with or without promtool)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    ours = {n.split(":", 1)[1]: f for n, f in families.items() if n.startswith(PREFIXES)}
    assert {f.name for f in ours.values()} == {metric_name(n) for n in ours}
    vllm_names = {n for n in families if n.startswith("vllm:")}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= vllm_names
    assert {n: f.type for n, f in ours.items()} == EXPECTED_FAMILIES
    for name, family in ours.items():
        assert family.documentation, name
        if name == "cache_config_info":  # vLLM's info gauge: the config in labels, value 1
            (sample,) = family.samples
            assert sample.value == 1 and sample.labels["block_size"] == str(BLOCK_SIZE)
            assert sample.labels["num_gpu_blocks"] == str(NUM_BLOCKS), sample.labels
            continue
        assert all(s.labels.get("model_name") == "tiny" for s in family.samples), name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), name
        if family.type == "histogram":
            _check_histogram(name, family.samples)
    for name, buckets in VLLM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in ours[name].samples if s.name.endswith("_bucket")]
        assert les == [*buckets, math.inf], name
    token_les = [
        float(s.labels["le"])
        for s in ours["request_prompt_tokens"].samples
        if s.name.endswith("_bucket")
    ]
    assert token_les[:7] == [1, 2, 5, 10, 20, 50, 100] and token_les[-1] == math.inf


def _check_histogram(name: str, samples) -> None:
    buckets = [s for s in samples if s.name.endswith("_bucket")]
    counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
    assert counts == sorted(counts), name
    (count,) = [s.value for s in samples if s.name.endswith("_count")]
    assert counts[-1] == count, name


# ---- structured logs and request ids -----------------------------------------------------------
# Engine request ids are "<response id>-<8 hex, unique per HTTP request>-<choice index>".
LOG_LINE = re.compile(
    r"request finished request_id=(?P<id>\S+)-[0-9a-f]{8}-(?P<choice>\d+) "
    r"finish_reason=(?P<reason>\w+) "
    r"prompt_tokens=(?P<prompt>\d+) generation_tokens=(?P<gen>\d+) ttft_s=(?P<ttft>[\d.]+) "
    r"e2e_s=(?P<e2e>[\d.]+) queue_s=[\d.]+ preemptions=\d+"
)


def test_one_log_line_per_finished_request_and_per_preemption(loaded_server):
    results = run_load(loaded_server.url, min_seconds=0, max_waves=1, concurrency=4)
    log = _wait_for_log(loaded_server, f"request_id={results[-1].json()['id']}-")
    _wait_for_log(loaded_server, f"request_id={results[0].json()['id']}-")
    lines = {m["id"]: m for m in LOG_LINE.finditer(loaded_server.log_path.read_text())}
    for r in results:
        body = r.json()
        line = lines[body["id"]]
        assert line["reason"] == "length" and int(line["gen"]) == MAX_TOKENS
        assert int(line["prompt"]) == body["usage"]["prompt_tokens"]
        assert 0 < float(line["ttft"]) <= float(line["e2e"])
    assert re.search(r"preempted request cmpl-\S+", log), "the scheduler logs each preemption"


def test_request_id_header_is_honoured_and_matches_body_and_log(loaded_server):
    results: list[httpx.Response] = []
    _complete(loaded_server.url, "trace me", results, headers={"X-Request-Id": "trace-42"})
    r = results[0]
    assert r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    log = _wait_for_log(loaded_server, "request_id=cmpl-trace-42-")
    assert [m["id"] for m in LOG_LINE.finditer(log) if "trace-42" in m["id"]] == ["cmpl-trace-42"]


def test_request_id_is_minted_when_absent_or_invalid(loaded_server):
    results: list[httpx.Response] = []
    _complete(loaded_server.url, "no id", results)
    _complete(loaded_server.url, "bad id", results, headers={"X-Request-Id": "has space"})
    for r in results:
        minted = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", minted)
        assert r.json()["id"] == f"cmpl-{minted}"
    health = httpx.get(loaded_server.url + "/health", headers={"X-Request-Id": "probe-1"})
    assert health.headers["x-request-id"] == "probe-1"


def _wait_for_log(server: ServerProcess, needle: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = server.log_path.read_text()
        if needle in log:
            return log
        time.sleep(0.1)
    return server.log_path.read_text()


def test_step_gauges_follow_every_change_and_counters_add_each_step():
    """observe() skips a gauge whose value did not change and a counter that did not grow: the
    exposition still reads each step's gauges and the counters' running sums."""
    from engine.outputs import StepStats
    from server.metrics import Metrics

    m = Metrics("m")

    def read(name: str) -> float:
        return metric_value(m.render().decode(), metric_name(name), {"model_name": "m"})

    busy = dict(num_running=3, num_waiting=2, num_total_blocks=64, num_free_blocks=40,
                num_cached_free_blocks=5, kv_cache_usage=0.375)
    steps = [
        StepStats(**busy, num_generation_tokens=3, num_prompt_tokens=20),
        StepStats(**busy, num_generation_tokens=3),  # a decode step: no gauge moves
        StepStats(**{**busy, "num_running": 0, "num_free_blocks": 64, "kv_cache_usage": 0.0}),
        StepStats(**busy, num_preemptions=1, prefix_cache_queries=32, prefix_cache_hits=16),
    ]
    want = [(3, 40, 24, 0.375, 3, 20, 0), (3, 40, 24, 0.375, 6, 20, 0),
            (0, 64, 0, 0.0, 6, 20, 0), (3, 40, 24, 0.375, 6, 20, 1)]
    for step, (running, free, used, usage, gen, prompt, preempted) in zip(steps, want):
        m.observe(step)
        assert read("num_requests_running") == running
        assert read("num_requests_waiting") == 2
        assert read("kv_cache_free_blocks") == free
        assert read("kv_cache_used_blocks") == used
        assert read("kv_cache_usage_perc") == usage
        assert read("kv_cache_cached_blocks") == 5
        assert read("kv_cache_total_blocks") == 64
        assert read("generation_tokens_total") == gen
        assert read("prompt_tokens_total") == prompt
        assert read("num_preemptions_total") == preempted
    assert read("prefix_cache_queries_total") == 32 and read("prefix_cache_hits_total") == 16
