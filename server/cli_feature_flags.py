"""The serve flags of the optional features, each in its --help group (server/cli.py's
SERVE_GROUPS): GGUF weights, pooling, images and LoRA under model, KV-cache events under cache,
tool calling and stored responses under frontend."""

from __future__ import annotations

import json

from engine.config import GGUF_WEIGHTS, PREFIX_CACHING_HASH_ALGOS
from engine.runner.pooling_config import RUNNERS, TASKS
from server.tools.registry import TOOL_PARSERS


def add_gguf_args(p) -> None:
    p.add_argument(
        "--gguf-weights",
        choices=list(GGUF_WEIGHTS),
        default="auto",
        help="a .gguf file's quantized linears on CPU: auto keeps the packed blocks for "
        "decode-sized calls and a dense bf16 copy for prefill-sized ones (most tokens/s; "
        "float32 and off-CPU: dense); packed: the blocks only (least memory, the same as "
        "--quantization gguf); dense: dequantized to --dtype (with float32, the exact path "
        "whose greedy tokens equal transformers') (default: auto)",
    )
    p.add_argument(
        "--mmproj",
        metavar="PATH",
        help="llama.cpp's mmproj GGUF (vision tower + projector) for a .gguf text model, as "
        "llama-server --mmproj: the model then takes images (projector types mlp: LLaVA, "
        "gemma3: Gemma 3, qwen2.5vl_merger: Qwen2.5-VL) "
        "(default: none)",
    )


def add_tool_args(p) -> None:
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
        help="the tool-call format read from the output; generic: tools in the system prompt, "
        "for templates with no tool support (default: read from the chat template)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="stored /v1/responses kept in memory, least recently used dropped first; 0 stores "
        "none (default: 1000)",
    )


def add_multimodal_args(p) -> None:
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
    p.add_argument(
        "--max-num-encoder-input-tokens",
        type=int,
        help="image placeholder tokens whose encoding may start in one step (a chunk stops "
        "before an image over it; one larger image runs alone); default: "
        "--max-num-batched-tokens",
    )


def add_pooling_args(p) -> None:
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


def add_lora_args(p) -> None:
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


def add_kv_events_args(p) -> None:
    """What routers read beside /metrics (engine/kv_events.py), named as vLLM's."""
    p.add_argument(
        "--kv-events-config",
        help="KV-cache events for prefix-aware routers, vLLM's JSON keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; the events carry prompt '
        "token ids; default off",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=list(PREFIX_CACHING_HASH_ALGOS),
        default="builtin",
        help="how the prefix cache hashes blocks: builtin (ours) or vLLM's sha256 / "
        "sha256_cbor (NONE_HASH from PYTHONHASHSEED, else 'vllm-none-hash'), so the KV "
        "events carry the hashes vLLM would for the same token ids (default: builtin)",
    )


def add_kv_offloading_args(p) -> None:
    """The second KV tier for the prefix cache (engine/kv_offload/), named as vLLM's."""
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        help="GiB of a second KV tier that keeps prefix-cache blocks evicted from the pool and "
        "loads them back on a hit instead of recomputing them (host memory under a GPU pool; "
        "on CPU: files on local disk, kept across restarts); default off",
    )
    p.add_argument(
        "--kv-offloading-backend",
        choices=("native", "disk", "cpu", "lmcache"),
        help="the tier's backend: native (vLLM's default: host memory when the pool is on a "
        "GPU, disk files on CPU), disk (files, persistent) or cpu (ours: host memory, not "
        "persistent, wherever the pool is); vLLM's lmcache is refused (its wheels need CUDA)",
    )
    p.add_argument(
        "--kv-offloading-dir",
        help="folder of the tier's files, one subfolder per model, dtype, block size and "
        "tokenizer (default: ~/.cache/pagedserve/kv_tier)",
    )
