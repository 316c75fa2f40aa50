"""EngineConfig: one flat dataclass, validated once at the edge, never mutated afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from engine.spec_decode.ngram import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton", "flash_attn")
_EXECUTORS = ("uni", "mp")
# --prefix-caching-hash-algo: ours, or vLLM's block hashes (engine/core/block_hashing.py)
PREFIX_CACHING_HASH_ALGOS = ("builtin", "sha256", "sha256_cbor")
# --gguf-weights: a GGUF's quantized linears on CPU (engine/layers/quantization/gguf.py)
GGUF_WEIGHTS = ("auto", "packed", "dense")
QUANTIZATION_METHODS = ("int8", "gguf")  # --quantization (engine/layers/quantization/int8.py)
# Per-step token budget when none is given. CPU steps hold at most 512 tokens so prompts finish
# one after another and wait less for their first token (throughput within noise); GPUs keep
# vLLM's 2048. Measured in bench/README.md, "Per-step token budget on CPU".
CPU_MAX_NUM_BATCHED_TOKENS = 512
GPU_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    mmproj: str | None = None  # llama.cpp's vision tower + projector GGUF for a .gguf model
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the model's own limit
    block_size: int | None = None  # None: 16, or 256 where flash-attn 2 will run
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 512 on CPU, 2048 on GPU
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: weights in dtype; "int8": W8A8 decoder linears
    # auto: packed blocks for decode-sized calls, dense above; packed: least memory; dense:
    # dequantized to dtype (float32: transformers' greedy tokens). A GGUF only.
    gguf_weights: str = "auto"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # uni: the model in the engine's thread; mp: in worker processes (engine/executor/executor.py).
    # None: uni at one rank, mp above (the only choice there).
    distributed_executor_backend: str | None = None
    nnodes: int = 1  # hosts one replica spans; each runs tensor_parallel_size / nnodes ranks
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # node 0's address: torch.distributed's TCP rendezvous
    master_port: int | None = None  # None: a free port (one host only)
    max_num_queued_reqs: int | None = None
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs for decode batches
    grammar_compile_timeout: float = 10.0  # seconds; a slower grammar is refused (400)
    # n-gram speculative decoding (engine/spec_decode/ngram.py); JSON text or a dict is parsed here
    speculative_config: SpeculativeConfig | None = None
    # images (engine/multimodal/): hosts http(s) image URLs may come from (None: none; vLLM's
    # --allowed-media-domains), the folder file:// URLs may read (None: none), per-image byte
    # and fetch-time limits, images per prompt (vLLM's --limit-mm-per-prompt {"image": N}),
    # and the bytes of image embeddings the runner keeps by content hash
    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    max_media_bytes: int = 20 * 1024**2
    media_fetch_timeout: float = 5.0
    limit_mm_per_prompt: dict | None = None
    mm_encoder_cache_bytes: int = 256 * 1024**2
    # image placeholder tokens whose encoding may start in one step (engine/core/encoder_budget.py;
    # vLLM's max_num_encoder_input_tokens); None: max_num_batched_tokens
    max_num_encoder_input_tokens: int | None = None
    # n > 1: the samples of a prompt are forks of one sequence sharing its KV blocks
    # (copy-on-write, engine/core/forks.py); False: n independent requests (prefix cache only).
    fork_parallel_samples: bool = True
    # multi-LoRA (engine/lora/): vLLM's --enable-lora, --lora-modules, --max-loras,
    # --max-lora-rank, --max-cpu-loras (None: max_loras)
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()  # "name=path" or vLLM's JSON form each
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV-cache events for routers (engine/kv_events.py): vLLM's JSON keys, text or a dict
    kv_events_config: object | None = None
    # "pooling": a causal embedder served on the scheduler, pooled instead of sampled
    # (engine/pooling_llm.py, engine/runner/pooling_hook.py); set by its builder, uni only
    runner: str = "generate"
    # the second KV tier for the prefix cache (engine/kv_offload/): vLLM's --kv-offloading-size
    # (GiB; None: off) and --kv-offloading-backend (native: host memory under a GPU pool, disk
    # on CPU; disk; cpu: host memory wherever the pool is); the folder
    # its files persist in (None: ~/.cache/pagedserve/kv_tier)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_dir: str | None = None

    def __post_init__(self) -> None:
        """Fills the defaults left unset, then checks every field (the first bad one raises)."""
        self._resolve_defaults()
        self._check_sizes()
        self._check_choices()
        self._check_parallel()
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise ValueError("max_num_queued_reqs must be positive")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be positive")
        self._check_speculative()
        self._check_media()
        self._check_lora()
        self._check_kv_offloading()
        if self.kv_events_config is not None:
            from engine.kv_events import KVEventsConfig

            parsed = KVEventsConfig.parse(self.kv_events_config)
            object.__setattr__(self, "kv_events_config", parsed)

    def _check_kv_offloading(self) -> None:
        backend = self.kv_offloading_backend
        if self.kv_offloading_size is None:
            if backend is not None or self.kv_offloading_dir is not None:
                raise ValueError("kv_offloading_backend/dir need kv_offloading_size (GiB)")
            return
        if not self.kv_offloading_size > 0:
            raise ValueError("kv_offloading_size must be a positive number of GiB")
        if backend == "lmcache":
            raise ValueError(
                "kv_offloading_backend lmcache is not available: LMCache's wheels need CUDA "
                "(libcudart, cupy) and numpy<=2.2.6; use native"
            )
        if backend not in (None, "native", "disk", "cpu"):
            raise ValueError(f"kv_offloading_backend must be native, disk or cpu, not {backend!r}")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    def _resolve_defaults(self) -> None:
        if self.block_size is None:  # resolved once here, so every reader sees one number
            from pagedserve_kernels import default_block_size

            object.__setattr__(
                self, "block_size", default_block_size(self.attention_backend, self.device)
            )
        if self.max_num_batched_tokens is None:
            object.__setattr__(
                self, "max_num_batched_tokens", default_max_num_batched_tokens(self.device)
            )

    def _check_sizes(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        for name in ("num_gpu_blocks_override", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    def _check_choices(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if self.quantization is not None and self.tensor_parallel_size > 1:
            # the int8 linears bind their own forward, without the row-parallel all-reduce
            raise ValueError("quantization is not supported with tensor_parallel_size > 1 yet")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {list(GGUF_WEIGHTS)}, "
                             f"got {self.gguf_weights!r}")
        if self.quantization == "gguf" and self.gguf_weights == "dense":
            raise ValueError("quantization 'gguf' serves the packed blocks; drop it for "
                             "gguf_weights 'dense'")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of "
                             f"{list(PREFIX_CACHING_HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r} (vLLM's xxhash variants are "
                             f"not offered)")

    def _check_speculative(self) -> None:
        if self.speculative_config is None:
            return
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if self.distributed_executor_backend != "uni":
            # the worker wire format carries no draft tokens
            raise ValueError(
                "speculative_config is not supported with tensor_parallel_size > 1 or "
                "distributed_executor_backend 'mp' yet"
            )

    def _check_media(self) -> None:
        for name in ("max_media_bytes", "media_fetch_timeout", "mm_encoder_cache_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower() for d in self.allowed_media_domains if d.strip())
            object.__setattr__(self, "allowed_media_domains", domains)
        limit = self.limit_mm_per_prompt
        if isinstance(limit, str):
            limit = json.loads(limit)
            object.__setattr__(self, "limit_mm_per_prompt", limit)
        if limit is not None and not (
            isinstance(limit.get("image", 0), int) and limit.get("image", 0) >= 0
        ):
            raise ValueError('limit_mm_per_prompt must be like {"image": 4}')

    @property
    def encoder_budget_tokens(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def max_images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", 8)

    def _check_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {n}")
        if self.distributed_executor_backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if n == 1 else "mp")
        backend = self.distributed_executor_backend
        if backend not in _EXECUTORS:
            raise ValueError(f"distributed_executor_backend must be one of {_EXECUTORS}")
        if backend == "uni" and (n > 1 or self.nnodes > 1):
            raise ValueError(
                "distributed_executor_backend 'uni' runs one rank; tensor_parallel_size > 1 "
                "and nnodes > 1 need 'mp'"
            )
        if self.nnodes < 1 or n % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {n} must be a multiple of nnodes ({self.nnodes})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_port (the same on every host)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def default_max_num_batched_tokens(device: str = "auto") -> int:
    from pagedserve_kernels import device_type  # "auto" -> cuda or cpu, "cuda:1" -> cuda

    on_cpu = device_type(device) == "cpu"
    return CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else GPU_MAX_NUM_BATCHED_TOKENS
