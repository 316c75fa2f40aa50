"""`pagedserve serve [MODEL] ...`: flags named like `vllm serve`, optional --config YAML."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from engine.config import EngineConfig

logger = logging.getLogger("pagedserve")


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
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--max-num-queued-reqs", type=int)
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash_attn"]
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument("--log-level", default="info")


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
    names = EngineConfig.field_names()
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from server.app import build_app
    from server.metrics import Metrics

    engine = LLMEngine(engine_config(args))
    print(f"pagedserve: attention backend: {engine.runner.backend.name}", flush=True)
    metrics = Metrics(engine.model_name)
    async_engine = AsyncEngine(engine, metrics.observe, args.max_num_queued_reqs)
    async_engine.start()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)  # own copy: engine thread decodes
    app = build_app(async_engine, tokenizer, engine.model_name, metrics)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            serve(args)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
