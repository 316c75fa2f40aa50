"""`pagedserve serve [MODEL] ...`: flags named like `vllm serve`, optional --config YAML."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from collections.abc import Callable

import yaml

from engine.config import EngineConfig
from server import cli_feature_flags as features
from server import cli_flags
from server.cli_help import EXAMPLES, ServeHelpFormatter, group_help

logger = logging.getLogger("pagedserve")


# The --help groups, in vLLM's order: (title, one-line description, the functions adding its
# flags). A new area's `_add_<area>_args(p)` goes into the group it belongs to; every flag
# needs a help text (tests/test_cli_help.py fails otherwise, and on docs/serving.md drifting:
# `python -m server.cli_help --markdown --write docs/serving.md` regenerates its table).
SERVE_GROUPS: list[tuple[str, str, list[Callable]]] = [
    (
        "model",
        "what is served and how it computes",
        [
            cli_flags.add_model_args,
            features.add_gguf_args,
            features.add_pooling_args,
            features.add_multimodal_args,
            features.add_lora_args,
        ],
    ),
    (
        "cache",
        "the paged KV cache",
        [cli_flags.add_cache_args, features.add_kv_events_args, features.add_kv_offloading_args],
    ),
    ("scheduler", "batching and queueing", [cli_flags.add_scheduler_args]),
    ("parallel", "ranks, workers and hosts", [cli_flags.add_parallel_args]),
    (
        "frontend",
        "the HTTP server and its endpoints",
        [cli_flags.add_frontend_args, features.add_tool_args, cli_flags.add_connection_args],
    ),
    ("security", "who may call and how much they may send", [cli_flags.add_security_args]),
    ("logging", "what the server logs", [cli_flags.add_logging_args]),
]


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    for title, description, adders in SERVE_GROUPS:
        group = p.add_argument_group(title, description)
        for add in adders:
            add(group)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible API",
        usage="pagedserve serve [MODEL] [flags]  (--help=GROUP for one group)",
        description="Serve a model over an OpenAI-compatible HTTP API (flags named as vLLM's).",
        formatter_class=ServeHelpFormatter,
        epilog=EXAMPLES,
    )
    _add_serve_args(serve_parser)
    return parser, serve_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser, serve_parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    asked = [a.split("=", 1)[1] for a in argv if a.startswith("--help=")]
    if asked:  # vLLM's --help=GROUP: one group's flags
        print(group_help(serve_parser, asked[0]), end="")
        sys.exit(0)
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
    build = lambda: build_server(args, state, switch.set_stage)
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


def build_server(args: argparse.Namespace, state=None, stage=lambda _: None):
    """Loads the model and builds the app (on the loader thread); returns (engine, app).

    state: the ServerState whose draining flag ends the app's long-lived streams; stage: told
    what loading is doing (the 503 body while it loads)."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from engine.pooling_engine import wants_pooling
    from server.app import build_app
    from server.metrics import Metrics
    from server.tools.detect import choose_tool_parser, template_text

    if wants_pooling(args.model, args.runner, args.task, args.hf_overrides):
        return build_pooling_server(args, state)
    if args.hf_overrides:
        raise ValueError("--hf-overrides is applied by the pooling runner only (so far)")
    engine = LLMEngine(_prepare(engine_config(args), stage))
    metrics = Metrics(engine.model_name)
    metrics.cache_config_info(
        engine.config.block_size, engine.executor.num_blocks,
        enable_prefix_caching=engine.config.enable_prefix_caching,
    )  # fmt: skip
    metrics.watch_kv_memory(engine)
    if state is not None:
        metrics.watch_connections(state.connections)
    metrics.observe(engine.snapshot_stats())  # block gauges read true before the first step
    async_engine = AsyncEngine(engine, metrics.observe, args.max_num_queued_reqs)
    tools = choose_tool_parser(
        template_text(engine.tokenizer), args.tool_call_parser, args.disable_auto_tool_choice
    )
    print(tools.log_line(), flush=True)
    kv_view = None if args.disable_playground else async_engine.kv_view
    app = build_app(
        async_engine, metrics, tools.parser, kv_view, args.responses_store_size, tools.call_format
    )
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
    from engine.pooling_llm import pools_on_scheduler
    from server.app import build_app
    from server.metrics import Metrics

    config = engine_config(args)
    if args.max_num_batched_tokens is None:
        config = replace(config, max_num_batched_tokens=POOLING_MAX_NUM_BATCHED_TOKENS)
    if pools_on_scheduler(args.model, args.hf_overrides):  # a decoder embedder
        return _build_scheduled_pooling_server(args, config, state)
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


def _build_scheduled_pooling_server(args: argparse.Namespace, config: EngineConfig, state):
    """A causal embedder on the shared scheduler (engine/pooling_llm.py): chunked prefill,
    prefix caching and the generating server's metrics."""
    from engine.pooling_llm import AsyncPoolingLLMEngine, build_pooling_llm_engine
    from server.app import build_app
    from server.metrics import Metrics

    llm = build_pooling_llm_engine(config)
    metrics = Metrics(llm.model_name, llm.config.max_model_len)
    metrics.cache_config_info(
        llm.config.block_size, llm.executor.num_blocks,
        enable_prefix_caching=llm.config.enable_prefix_caching,
    )  # fmt: skip
    if state is not None:
        metrics.watch_connections(state.connections)
    metrics.observe(llm.snapshot_stats())
    engine = AsyncPoolingLLMEngine(llm, metrics.observe, args.max_num_queued_reqs)
    print(f"pagedserve: pooling on the scheduler: {llm.executor.backend_name}", flush=True)
    app = build_app(engine, metrics, None, None)
    if state is not None:
        app.state.is_draining = lambda: state.draining
    engine.start()
    return engine, app


def _prepare(config: EngineConfig, stage) -> EngineConfig:
    """The slow first-start steps, each named to /health: the model files (a GGUF converted
    once), the CPU kernels (compiled once per source change); then the weights and KV cache."""
    from engine.model_loader.loader import resolve_model
    from pagedserve_kernels import cpu_ops

    stage("reading the model (a GGUF is converted on first use)")
    resolve_model(config.model, config.mmproj)  # cached: the engine's own call finds the result
    if config.device in ("auto", "cpu") and cpu_ops.cpu_kernels_enabled():
        if not cpu_ops.is_built():
            stage(f"compiling the CPU kernels ({cpu_ops.BUILD_TIME_HINT})")
        cpu_ops.load_cpu_ops()
    stage("loading the weights and allocating the KV cache")
    return config


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
        model_dir = resolve_model(args.model, getattr(args, "mmproj", None))
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
