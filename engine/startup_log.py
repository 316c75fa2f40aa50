"""The engine's ready line: every start-up decision once, with where it came from."""

from __future__ import annotations

from engine.config import EngineConfig


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def max_model_len_source(requested: int | None, model_max: int) -> str:
    if requested is not None:
        return "--max-model-len"
    return "the model's own limit; --max-model-len lowers it"


def kernels_used(device) -> str:
    """Which compute path the CPU linears and attention take."""
    if str(device) != "cpu":
        return "torch/CUDA ops"
    from pagedserve_kernels import cpu_ops

    if cpu_ops.cpu_kernels_enabled() and cpu_ops.is_built():
        return "C++ CPU kernels (pagedserve_kernels/csrc)"
    return "plain torch ops (no C++ kernels: PAGEDSERVE_CPU_KERNELS=0 or no compiler)"


def ready_line(engine, requested_len: int | None) -> str:
    """One line: model and architecture, dtype, max_model_len and why, the KV cache in bytes,
    blocks and tokens, attention backend, kernels, quantization and executor."""
    cfg: EngineConfig = engine.config
    hf = engine.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    model_max = getattr(hf, "max_position_embeddings", None) or cfg.max_model_len
    ex = engine.executor
    tokens = ex.num_blocks * cfg.block_size
    kv_bytes = getattr(ex, "kv_cache_bytes", None)
    size = f"{_gib(kv_bytes)} ({kv_bytes:,} bytes), " if kv_bytes else ""
    parts = [
        f"model {engine.model_name} ({arch}) from {engine.model_dir}",
        f"dtype {str(ex.dtype).replace('torch.', '')} on {ex.device}",
        f"max_model_len {cfg.max_model_len} ({max_model_len_source(requested_len, model_max)})",
        f"KV cache {size}{ex.num_blocks:,} blocks x {cfg.block_size} = {tokens:,} tokens",
        f"attention backend {ex.backend_name}",
        f"kernels: {kernels_used(ex.device)}",
        f"quantization {_quantization(cfg, engine.model_dir)}",
        f"executor {cfg.distributed_executor_backend} x {cfg.tensor_parallel_size}",
    ]
    if cfg.speculative_config is not None:
        parts.append(f"speculative {cfg.speculative_config}")
    return "engine ready: " + "; ".join(parts)


def _quantization(cfg: EngineConfig, model_dir) -> str:
    """The flag's method, or for a GGUF file (a converted folder holding its packed blocks)
    the --gguf-weights mode; the runner's own `gguf:` line says which linears and why."""
    from pathlib import Path

    from engine.gguf.convert import BLOCKS_FILE

    if cfg.quantization is None and (Path(model_dir) / BLOCKS_FILE).exists():
        return f"gguf file, --gguf-weights {cfg.gguf_weights}"
    return cfg.quantization or "none"


def quiet_tokenizer(tokenizer) -> None:
    """The engine checks prompt lengths itself (a 400 naming max_model_len): transformers'
    "Token indices sequence length is longer than ..." warning on a refused prompt is noise."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
