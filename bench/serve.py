"""Async load generator for any OpenAI-compatible server (streamed /v1/completions).

Fixed-seed workloads, prompts sent as token-id lists so every server sees the same tokens:
  std     64 requests, 256 random prompt tokens, 128 output tokens, <= 32 in flight
  prefix  64 requests sharing a 512-token prefix + 128 random tokens, 64 output tokens, <= 32
  mixed   ShareGPT-like long-tail lengths (log-normal), Poisson arrivals at a fixed rate
  repeat  64 chat prompts asking to rewrite a Python function (40-120 tokens, from the standard
          library's sources) with one parameter renamed; as many output tokens as the function
          has, <= 32 in flight.
          The output repeats the prompt, the case n-gram speculation is for; the summary's
          copied_share says how much of the output did (word 4-grams found in the prompt)

Every request asks for ignore_eos and greedy decoding, and must come back with exactly the
asked number of tokens (from the stream's usage chunk); anything else counts as a failure.

  python bench/serve.py --base-url http://127.0.0.1:8000 --workload std --out std.json

--hf-static (was bench/hf_static.py), the naive baseline: no server; Hugging Face transformers'
static batching in this process on the same prompts. Requests all arrive at t=0 and run in
arrival order as left-padded batches of --batch-size through `generate` (greedy, exactly
max_tokens new tokens each). A batch starts only when the one before it has finished, as a
server without continuous batching would run them. Times come from a logits processor that
fires once per decoding step, so TTFT and ITL are per token.

  python bench/serve.py --hf-static --workload std --out hf_std.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

WORKLOADS = ("std", "prefix", "mixed", "repeat")
_MIN_TOKEN_ID = 100  # keeps clear of the special tokens at the start of the vocabulary


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_offset: float = 0.0  # seconds after start; 0 for closed-loop workloads
    source_text: str = ""  # repeat: what the output should copy


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    max_concurrency: int | None
    request_rate: float  # requests/s; inf sends as fast as max_concurrency allows


@dataclass
class RequestResult:
    ok: bool
    num_output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    retried: bool = False  # sent a second time: the server had closed the connection unanswered

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT): the decode rate one request
        saw, whatever number of tokens each streamed chunk carried."""
        if self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


# ---- workloads -------------------------------------------------------------------------------
def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(_MIN_TOKEN_ID, vocab_size, size=n).tolist()


def build_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    max_concurrency: int | None = None,
    request_rate: float | None = None,
    max_model_len: int = 2048,
    model_dir: str | None = None,
) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "repeat":
        reqs = _repeat_requests(rng, num_requests or 64, model_dir)
        return Workload(name, reqs, max_concurrency or 32, request_rate or math.inf)
    if name == "std":
        n = num_requests or 64
        reqs = [BenchRequest(_random_ids(rng, 256, vocab_size), 128) for _ in range(n)]
        return Workload(name, reqs, max_concurrency or 32, request_rate or math.inf)
    if name == "prefix":
        n = num_requests or 64
        prefix = _random_ids(rng, 512, vocab_size)
        reqs = [BenchRequest(prefix + _random_ids(rng, 128, vocab_size), 64) for _ in range(n)]
        return Workload(name, reqs, max_concurrency or 32, request_rate or math.inf)
    if name == "mixed":
        return _mixed_workload(
            rng, vocab_size, num_requests or 64, request_rate or 4.0, max_concurrency, max_model_len
        )
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


# Standard-library modules whose functions the repeat workload asks the model to copy; the
# sources are the running Python's, so every server in one run sees the same prompts.
_REPEAT_MODULES = (
    "textwrap", "json.encoder", "heapq", "bisect", "fractions", "statistics", "shlex", "difflib",
    "calendar", "csv", "string", "ipaddress", "pprint", "colorsys", "html", "fnmatch", "glob",
    "gettext",
)  # fmt: skip
# A rename of a short function (not "repeat exactly" of a long one): asked that, the default
# model copies most of the prompt's code (bench/spec_decode.py's prompt); asked to repeat a long
# function verbatim, it drifts off after a few lines.
_REPEAT_INSTRUCTION = (
    "Rewrite this Python code with the variable `{old}` renamed to `{new}`. "
    "Output only the code.\n\n```python\n{code}```"
)


def repeat_sources(tokenizer, min_tokens: int = 100, max_tokens: int = 300) -> list[str]:
    import importlib
    import inspect

    sources = []
    for module_name in _REPEAT_MODULES:
        module = importlib.import_module(module_name)
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if min_tokens <= len(tokenizer.encode(src, add_special_tokens=False)) <= max_tokens:
                sources.append(src)
    return sources


def rename_target(src: str) -> str | None:
    """The function's first parameter other than self/cls, if the body uses it too."""
    import keyword

    header = src.split("(", 1)
    if len(header) < 2:
        return None
    for name in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\b", header[1].split(")", 1)[0]):
        if name not in ("self", "cls") and len(re.findall(rf"\b{name}\b", src)) >= 2:
            return None if keyword.iskeyword(name) else name
    return None


def _repeat_requests(rng: np.random.Generator, n: int, model_dir: str | None) -> list:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir or _default_model_dir())
    sources = [s for s in repeat_sources(tokenizer, 40, 120) if rename_target(s)]
    picks = rng.permutation(len(sources))
    reqs = []
    for k in range(n):
        src = sources[int(picks[k % len(picks)])]
        old = rename_target(src)
        content = _REPEAT_INSTRUCTION.format(old=old, new=f"{old}_value", code=src)
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template has its specials
        n_out = len(tokenizer.encode(src, add_special_tokens=False))
        reqs.append(BenchRequest(list(ids), n_out, source_text=src))
    return reqs


def copied_share(output: str, source: str, n: int = 4) -> float:
    """Share of the output's word n-grams that occur in the source (1.0: a pure copy)."""
    out, src = output.split(), source.split()
    grams = {tuple(src[i : i + n]) for i in range(len(src) - n + 1)}
    outs = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else 0.0


def _default_model_dir() -> str:
    from engine.model_loader.loader import resolve_model

    return str(resolve_model(None))


def _mixed_workload(rng, vocab_size, n, rate, max_concurrency, max_model_len) -> Workload:
    """Log-normal prompt/output lengths (ShareGPT-like long tail), Poisson arrivals."""
    prompt_lens = np.clip(rng.lognormal(np.log(180), 0.9, n), 8, 1024).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(120), 0.8, n), 4, 512).astype(int)
    output_lens = np.minimum(output_lens, max_model_len - prompt_lens)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    reqs = [
        BenchRequest(_random_ids(rng, int(p), vocab_size), int(o), float(a))
        for p, o, a in zip(prompt_lens, output_lens, arrivals)
    ]
    return Workload("mixed", reqs, max_concurrency, rate)


# ---- one request -----------------------------------------------------------------------------
async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest
) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage_tokens = None
    retried = False
    try:
        request = client.build_request("POST", url, json=body)
        try:
            resp = await client.send(request, stream=True)
        except httpx.RemoteProtocolError:
            # The server closed a kept-alive connection without answering (llama-server does,
            # now and then, on a connection that has served streams): sent again once on a new
            # connection, as the OpenAI SDK retries a connection error; the timer keeps running.
            retried = True
            resp = await client.send(request, stream=True)
        try:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    return RequestResult(ok=False, error=str(data["error"])[:200])
                if data.get("choices"):
                    chunk_times.append(time.perf_counter())
                    pieces.append(data["choices"][0].get("text") or "")
                if data.get("usage"):
                    usage_tokens = data["usage"]["completion_tokens"]
        finally:
            await resp.aclose()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:200])
    result = _finish_result(req, start, chunk_times, usage_tokens)
    result.text = "".join(pieces)
    result.retried = retried
    return result


def _finish_result(req, start, chunk_times, usage_tokens) -> RequestResult:
    if not chunk_times:
        return RequestResult(ok=False, error="no tokens streamed")
    n = usage_tokens if usage_tokens is not None else len(chunk_times)
    result = RequestResult(
        ok=n == req.max_tokens,
        num_output_tokens=n,
        ttft=chunk_times[0] - start,
        latency=chunk_times[-1] - start,
        itls=np.diff(chunk_times).tolist(),
    )
    if not result.ok:
        result.error = f"expected {req.max_tokens} tokens, got {n}"
    return result


# ---- the run ---------------------------------------------------------------------------------
async def run_workload(base_url: str, model: str, wl: Workload) -> tuple[list, float]:
    url = base_url.rstrip("/") + "/v1/completions"
    limit = wl.max_concurrency or len(wl.requests)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            delay = req.arrival_offset - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                return await send_request(client, url, model, req)

        results = await asyncio.gather(*(one(r) for r in wl.requests))
        duration = time.perf_counter() - start
    return results, duration


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0  # milliseconds
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(label: str, wl: Workload, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(len(q.prompt_token_ids) for q, r in zip(wl.requests, results) if r.ok)
    errors = sorted({r.error for r in results if not r.ok})
    copied = [copied_share(r.text, q.source_text) for q, r in zip(wl.requests, results) if r.ok]
    summary = {
        "label": label,
        "workload": wl.name,
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "errors": errors[:5],
        "num_retried": sum(r.retried for r in results),
        "max_concurrency": wl.max_concurrency,
        "request_rate": None if math.isinf(wl.request_rate) else wl.request_rate,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_throughput": out_tokens / duration,
        "request_throughput": len(ok) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "itl_ms": _percentiles([x for r in ok for x in r.itls]),
        "e2el_ms": _percentiles([r.latency for r in ok]),
        "tpot_ms": _percentiles([t for r in ok if (t := r.tpot) is not None]),
    }
    if wl.name == "repeat" and copied:
        summary["copied_share"] = float(np.mean(copied))
        summary["sample_output"] = next(r.text for r in results if r.ok)[:400]
    return summary


def cpu_jiffies() -> list[int] | None:
    """The machine's CPU time by kind since boot (/proc/stat's `cpu` line), None off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Of the CPU time that passed, the share the hypervisor gave to other guests (steal, the
    8th field): on a shared virtual machine, what a cell lost that the other cells may not have."""
    if before is None or after is None or len(before) < 8:
        return None
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta[:8])  # user .. steal; guest time is already counted in user
    return delta[7] / total if total > 0 else None


def print_summary(s: dict) -> None:
    print(
        f"[{s['label']}/{s['workload']}] {s['num_completed']}/{s['num_requests']} ok "
        f"({s['num_failed']} failed"
        + (f", {s['num_retried']} sent twice" if s.get("num_retried") else "")
        + f") in {s['duration_s']:.1f}s: "
        f"{s['output_throughput']:.1f} out tok/s, {s['request_throughput']:.2f} req/s, "
        f"TTFT median {s['ttft_ms']['median']:.0f} ms p90 {s['ttft_ms']['p90']:.0f} "
        f"p99 {s['ttft_ms']['p99']:.0f}, ITL median {s['itl_ms']['median']:.1f} ms "
        f"p90 {s['itl_ms']['p90']:.1f} p99 {s['itl_ms']['p99']:.1f}, "
        f"TPOT median {s['tpot_ms']['median']:.1f} ms p90 {s['tpot_ms']['p90']:.1f}"
        + (f", copied {s['copied_share']:.2f}" if "copied_share" in s else "")
        + (f", steal {100 * s['steal_share']:.0f}%" if s.get("steal_share") is not None else "")
    )
    for e in s["errors"]:
        print(f"  error: {e}")


def _vocab_size(model_dir: str | None) -> int:
    if model_dir is None:
        model_dir = _default_model_dir()
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


async def _served_model(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def _warmup(base_url: str, model: str, vocab_size: int) -> None:
    wl = Workload("warmup", [BenchRequest(list(range(200, 264)), 8)] * 2, 2, math.inf)
    await run_workload(base_url, model, wl)


# ---- --hf-static: transformers' static batching on the same prompts (was bench/hf_static.py) --
def run_batch(model, batch, pad_id: int) -> list[float]:
    """One padded batch; the step times (first is the first token of every row)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class _StepClock(LogitsProcessor):
        """Records the wall time of every decoding step (one new token per row)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):  # left padding keeps every row's last token aligned
        ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids) :] = 1
    max_new = max(r.max_tokens for r in batch)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    return clock.times


def hf_static(args: argparse.Namespace) -> dict:
    """--hf-static: the requests through transformers' generate, as described at the top."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.workload == "repeat":
        raise SystemExit("--hf-static runs std, prefix and mixed")
    if args.model_dir is None:
        from engine.model_loader.loader import resolve_model

        args.model_dir = str(resolve_model(None))
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    wl = build_workload(args.workload, vocab, args.seed, args.num_requests)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    pad_id = model.config.pad_token_id or model.config.eos_token_id or 0
    run_batch(model, wl.requests[:2], pad_id)  # warm-up, as a server is warmed up

    results: list[RequestResult] = []
    start = time.perf_counter()
    for b in range(0, len(wl.requests), args.batch_size):
        batch = wl.requests[b : b + args.batch_size]
        sent = time.perf_counter()  # the batch's requests are in flight from here
        times = run_batch(model, batch, pad_id)
        for r in batch:  # a row's tokens are the first max_tokens steps of its batch
            own = times[: r.max_tokens]
            itls = [t1 - t0 for t0, t1 in zip(own, own[1:])]
            results.append(RequestResult(True, len(own), own[0] - sent, own[-1] - sent, itls))
    duration = time.perf_counter() - start
    wl.max_concurrency = args.batch_size
    summary = summarize(args.label, wl, results, duration)
    print_summary(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="served model name; default: the first of /v1/models")
    p.add_argument("--model-dir", help="HF folder for vocab_size; default: pagedserve's default")
    p.add_argument("--workload", choices=WORKLOADS, default="std")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--request-rate", type=float, help="requests/s (mixed: default 4)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", help="default: server (--hf-static: hf-static)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", help="write the summary JSON here")
    p.add_argument("--hf-static", action="store_true",
                   help="no server: transformers' static batching in this process (see above)")
    p.add_argument("--batch-size", type=int, default=32, help="--hf-static: rows per batch")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="--hf-static: the model's dtype")
    args = p.parse_args(argv)
    if args.label is None:
        args.label = "hf-static" if args.hf_static else "server"
    if args.hf_static:
        return hf_static(args)

    vocab = _vocab_size(args.model_dir)
    wl = build_workload(
        args.workload,
        vocab,
        args.seed,
        args.num_requests,
        args.max_concurrency,
        args.request_rate,
        args.max_model_len,
        args.model_dir,
    )
    model = args.model or asyncio.run(_served_model(args.base_url))
    if not args.no_warmup:
        asyncio.run(_warmup(args.base_url, model, vocab))
    before = cpu_jiffies()
    results, duration = asyncio.run(run_workload(args.base_url, model, wl))
    summary = summarize(args.label, wl, results, duration)
    summary["steal_share"] = steal_share(before, cpu_jiffies())
    print_summary(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
