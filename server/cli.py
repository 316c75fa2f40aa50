"""`pagedserve serve [MODEL] ...`: flags named like `vllm serve`, optional --config YAML."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys

import yaml

from engine.config import GGUF_WEIGHTS, QUANTIZATION_METHODS, EngineConfig
from engine.runner.pooling_config import RUNNERS, TASKS
from server.tools.detect import choose_tool_parser, template_text
from server.tools.registry import TOOL_PARSERS

logger = logging.getLogger("pagedserve")


def _add_gguf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gguf-weights",
        choices=list(GGUF_WEIGHTS),
        default="auto",
        help="a .gguf file's quantized linears on CPU: auto keeps the packed blocks for "
        "decode-sized calls and a dense bf16 copy for prefill-sized ones (most tokens/s; "
        "float32 and off-CPU: dense); packed: the blocks only (least memory, the same as "
        "--quantization gguf); dense: dequantized to --dtype (with float32, the exact path "
        "whose greedy tokens equal transformers'). Default: auto",
    )


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    """Tool calling: on by default, its format read from the chat template."""
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted for vLLM compatibility: tool_choice "auto" is on unless '
        "--disable-auto-tool-choice (default: on)",
    )
    p.add_argument(
        "--disable-auto-tool-choice",
        action="store_true",
        help='refuse tool_choice "auto" (tools still reach the template; "required" and a '
        "named tool still work) (default: off)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="the tool-call format read from the output (default: read from the chat template)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="stored /v1/responses kept in memory, least recently used dropped first; 0 stores "
        "none (default: 1000)",
    )


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder or .gguf file; omitted: embedded SmolLM2-135M-Instruct",
    )
    p.add_argument("--config", help="YAML file of flags (CLI flags win)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, help="default 16; 256 on flash-attn 2")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens per step; default 512 on CPU, 2048 on GPU",
    )
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        choices=list(QUANTIZATION_METHODS),
        help="int8: W8A8 decoder linears (per-channel weight, per-token activation scales); "
        "gguf: a .gguf file's quantized linears served packed",
    )
    _add_gguf_args(p)
    p.add_argument(
        "--speculative-config",
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'',
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument(
        "--max-num-queued-reqs",
        type=int,
        help="waiting-queue bound; beyond it requests get 503 with Retry-After",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require the API key on /metrics too (public by default, like vLLM)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a request may take end to end; then it is aborted with an error",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are failed; "
        "0: fail them at once",
    )
    _add_connection_args(p)
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="/health turns 503 (and the process exits 1) after this long without engine "
        "progress while work is pending",
    )
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash_attn"]
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    _add_parallel_args(p)
    _add_model_feature_args(p)
    _add_fleet_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's greedy tokens independent of the batch (CPU kernels; also "
        "PAGEDSERVE_BATCH_INVARIANT=1 or VLLM_BATCH_INVARIANT=1)",
    )
    _add_tool_args(p)
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output grammar may take to compile; slower ones get 400",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--disable-playground",
        action="store_true",
        help="no playground page at / and no /kv/snapshot, /kv/stream (404)",
    )


def _add_multimodal_args(p: argparse.ArgumentParser) -> None:
    """Images in (vision-language models): where image URLs may come from, and limits."""
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        help="hosts http(s) image URLs may be fetched from (exact names); default: none",
    )
    p.add_argument(
        "--allowed-local-media-path",
        help="folder file:// image URLs may read from; default: none",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        help='JSON, most images per prompt, e.g. \'{"image": 4}\'; default: {"image": 8}',
    )
    p.add_argument(
        "--max-media-bytes",
        type=int,
        default=20 * 1024**2,
        help="largest encoded image accepted, in bytes; default: 20 MiB",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=5.0,
        help="seconds to fetch one image URL; default: 5",
    )
    p.add_argument(
        "--mm-encoder-cache-bytes",
        type=int,
        default=256 * 1024**2,
        help="image embeddings kept by content hash (LRU), in bytes; default: 256 MiB",
    )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Executor and multi-host flags (engine/executor/executor.py), named as vLLM's."""
    p.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp"],
        help="uni: the model in the server's process; mp: in worker processes (a worker crash "
        "is reported, the server exits 1); default uni at one rank, mp above",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts one replica spans")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 serves HTTP")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for the rendezvous")
    p.add_argument("--master-port", type=int, help="rendezvous port; default a free one")
    p.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's model workers (node rank > 0), no HTTP server",
    )


def _add_model_feature_args(p: argparse.ArgumentParser) -> None:
    """Images, pooling (embeddings) and LoRA adapters."""
    _add_multimodal_args(p)
    _add_pooling_args(p)
    _add_lora_args(p)


def _add_pooling_args(p: argparse.ArgumentParser) -> None:
    """Pooling models (embeddings): engine/pooling_engine.py; names as vLLM's."""
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="auto",
        help="generate: text generation; pooling: embeddings (/v1/embeddings); auto: pooling "
        "for a sentence-transformers folder or an encoder, else generate; default auto",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default="auto",
        help="vLLM's older spelling of --runner (embed: pooling); default auto",
    )
    p.add_argument(
        "--hf-overrides",
        type=json.loads,
        help="JSON set on the model's config before loading (pooling runner), e.g. Qwen3-"
        'Reranker\'s \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"]}\'; default none',
    )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """Multi-LoRA serving, vLLM's flags (engine/lora/)."""
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters; a request picks one by its `model` field (default: off)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help="PEFT adapter folders as name=path or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (default: none)',
    )
    p.add_argument(
        "--max-loras", type=int, default=1, help="adapter slots in one step (default: 1)"
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=16, help="largest adapter rank (default: 16)"
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters kept loaded, least recently used evicted (default: --max-loras)",
    )


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    """What routers read beside /metrics (engine/kv_events.py), named as vLLM's."""
    p.add_argument(
        "--kv-events-config",
        help="KV-cache events for prefix-aware routers, vLLM's JSON keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; the events carry prompt '
        "token ids; default off",
    )


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    """Connection-level limits (server/connection_guard.py); names follow uvicorn's flags."""
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=65.0,
        help="seconds an idle keep-alive connection stays open; longer than client pools and "
        "load balancers keep idle connections, so reuse does not race the close",
    )
    p.add_argument(
        "--timeout-request-header",
        type=float,
        default=20.0,
        help="seconds a request's headers may take (from the accept, or from the first byte "
        "on a reused connection); then 408 and close",
    )
    p.add_argument(
        "--timeout-request-body",
        type=float,
        default=60.0,
        help="seconds a request's body may take after its headers; then 408 and close",
    )
    p.add_argument(
        "--limit-connections",
        type=int,
        help="open connections beyond which new ones get 503; default and upper bound: the "
        "descriptor limit (ulimit -n) less a reserve",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        help="requests in flight beyond which new ones get 503 (/health, /ping, /metrics, "
        "/version exempt); default: bounded by the connections only",
    )
    p.add_argument("--backlog", type=int, default=2048, help="listen() backlog")


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    _add_serve_args(serve_parser)
    return parser, serve_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser, serve_parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:  # YAML values become defaults, so explicit flags still win
        with open(args.config) as f:
            defaults = {k.replace("-", "_"): v for k, v in (yaml.safe_load(f) or {}).items()}
        unknown = set(defaults) - set(vars(args))
        if unknown:
            parser.error(f"unknown keys in {args.config}: {sorted(unknown)}")
        serve_parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if getattr(args, "batch_invariant", False):  # read by the kernels as the model loads
        os.environ["PAGEDSERVE_BATCH_INVARIANT"] = "1"
    names = EngineConfig.field_names()
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def serve(args: argparse.Namespace) -> int:
    """Listens at once (/health 503 while loading), then serves; returns the exit status."""
    import asyncio

    import uvicorn

    from server.connection_guard import protocol_class
    from server.lifecycle import LifecycleSettings, SwitchApp, run_server
    from server.middleware import GuardMiddleware, ServerState

    state, switch = ServerState(), SwitchApp()
    guard = GuardMiddleware(switch, guard_settings(args), state)
    limits = connection_limits(args)
    # lifespan off: the app is built after the socket opens, so it has no startup hook to run.
    config = uvicorn.Config(
        guard,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
        timeout_graceful_shutdown=5,
        http=protocol_class(limits, state.connections, state.log),
        timeout_keep_alive=args.timeout_keep_alive,
        backlog=args.backlog,
    )
    settings = LifecycleSettings(args.shutdown_timeout, args.engine_stall_timeout)
    build = lambda: build_server(args, state)
    return asyncio.run(run_server(config, switch, state, build, settings))


def connection_limits(args: argparse.Namespace):
    from server.connection_guard import ConnectionLimits

    return ConnectionLimits(
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_request_header=args.timeout_request_header,
        timeout_request_body=args.timeout_request_body,
        limit_connections=args.limit_connections,
        limit_concurrency=args.limit_concurrency,
    )


def guard_settings(args: argparse.Namespace):
    from server.middleware import GuardSettings

    return GuardSettings(
        api_key=args.api_key or None,
        protect_metrics=args.protect_metrics,
        max_request_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
        timeout_request_body=args.timeout_request_body,
        limit_concurrency=args.limit_concurrency,
    )


def build_server(args: argparse.Namespace, state=None):
    """Loads the model and builds the app (on the loader thread); returns (engine, app).

    state: the ServerState whose draining flag ends the app's long-lived streams."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from engine.pooling_engine import wants_pooling
    from server.app import build_app
    from server.metrics import Metrics

    if wants_pooling(args.model, args.runner, args.task, args.hf_overrides):
        return build_pooling_server(args, state)
    if args.hf_overrides:
        raise ValueError("--hf-overrides is applied by the pooling runner only (so far)")
    engine = LLMEngine(engine_config(args))
    print(f"pagedserve: attention backend: {engine.executor.backend_name}", flush=True)
    metrics = Metrics(engine.model_name)
    metrics.cache_config_info(
        engine.config.block_size, engine.executor.num_blocks,
        enable_prefix_caching=engine.config.enable_prefix_caching,
    )
    if state is not None:
        metrics.watch_connections(state.connections)
    metrics.observe(engine.snapshot_stats())  # block gauges read true before the first step
    async_engine = AsyncEngine(engine, metrics.observe, args.max_num_queued_reqs)
    tools = choose_tool_parser(
        template_text(engine.tokenizer), args.tool_call_parser, args.disable_auto_tool_choice
    )
    print(tools.log_line(), flush=True)
    parser = tools.parser
    kv_view = None if args.disable_playground else async_engine.kv_view
    app = build_app(async_engine, metrics, parser, kv_view, args.responses_store_size)
    if state is not None:
        app.state.is_draining = lambda: state.draining
    async_engine.start()
    return async_engine, app


def build_pooling_server(args: argparse.Namespace, state=None):
    """build_server for a pooling model: (AsyncPoolingEngine, app)."""
    from dataclasses import replace

    from engine.pooling_engine import (
        POOLING_MAX_NUM_BATCHED_TOKENS,
        AsyncPoolingEngine,
        PoolingEngine,
    )
    from server.app import build_app
    from server.metrics import Metrics

    config = engine_config(args)
    if args.max_num_batched_tokens is None:
        config = replace(config, max_num_batched_tokens=POOLING_MAX_NUM_BATCHED_TOKENS)
    pooling = PoolingEngine(config, args.hf_overrides)
    metrics = Metrics(pooling.model_name, pooling.max_model_len)
    if state is not None:
        metrics.watch_connections(state.connections)
    engine = AsyncPoolingEngine(pooling, metrics.observe)
    print(f"pagedserve: pooling runner: {pooling.backend_name}", flush=True)
    app = build_app(engine, metrics, None, None)
    if state is not None:
        app.state.is_draining = lambda: state.draining
    engine.start()
    return engine, app


def run_headless(args: argparse.Namespace) -> int:
    """This host's share of the ranks, no HTTP: runs until the workers end (node 0 shut them
    down: 0; one failed or the rendezvous broke: 1) or SIGTERM stops them (0)."""
    import signal
    from multiprocessing.connection import wait

    from transformers import AutoConfig

    from engine.distributed import check_tensor_parallel
    from engine.executor.executor import WorkerGroup
    from engine.llm_engine import resolve_config
    from engine.model_loader.loader import resolve_model

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        model_dir = resolve_model(args.model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        config = resolve_config(engine_config(args), hf_config)
        check_tensor_parallel(hf_config, config.tensor_parallel_size)
        workers = WorkerGroup(config, model_dir, config.master_port)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr, flush=True)
        return 1
    where = f"{args.master_addr}:{args.master_port}"
    logger.info("headless: ranks %s joined the rendezvous at %s", workers.ranks, where)
    sentinels = [p.sentinel for p in workers.processes]
    while not stopping and len(wait(sentinels, timeout=0.5)) < len(sentinels):
        if workers.dead_worker() and any(p.exitcode for p in workers.processes):
            break
    for proc in workers.processes:  # a sentinel fires a moment before the exit status is known
        proc.join(0.0 if stopping else 5.0)
    codes = [p.exitcode for p in workers.processes]
    workers.stop()
    if stopping:
        return 0
    logger.info("headless: workers ended (%s)", codes)
    return 0 if all(c == 0 for c in codes) else 1


def main(argv: list[str] | None = None) -> None:
    # A native fault (SIGSEGV in a C++ kernel, SIGBUS, SIGFPE, SIGABRT, SIGILL) leaves every
    # thread's Python stack on stderr before the process dies by that signal.
    faulthandler.enable(all_threads=True)
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        _check_serve_args(args)
        code = run_headless(args) if args.headless else serve(args)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: a hung engine thread or a half-done load must not hold the process open.
        os._exit(code)


def _check_serve_args(args: argparse.Namespace) -> None:
    try:
        engine_config(args)  # flag errors surface before the socket opens
        positive = ("engine_stall_timeout", "request_timeout", "timeout_keep_alive")
        positive += ("timeout_request_header", "timeout_request_body")
        for name in positive:
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if args.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be 0 (abort at once) or positive")
        for name in ("max_request_body_bytes", "limit_connections", "limit_concurrency"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if args.headless and args.node_rank == 0:
            raise ValueError("--headless is for node ranks above 0 (node 0 serves HTTP)")
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
