"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.kv_cache_manager import cdiv
from engine.logprobs import compute_prompt_logprobs
from engine.models import SUPPORTED_ARCHITECTURES
from engine.models.llama import LlamaForCausalLM
from engine.outputs import ModelRunnerOutput
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from kernels import AttentionMetadata, get_attention_backend

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (exact, and the stored default weights are float32), else config's."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    stored = str(stored).replace("torch.", "") if stored else "bfloat16"
    return _DTYPES.get(stored, torch.bfloat16) if stored != "float32" else torch.bfloat16


def load_model(model_dir: Path, hf_config, backend, dtype, device) -> LlamaForCausalLM:
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {archs[0]} is not supported ({SUPPORTED_ARCHITECTURES})")
    model = LlamaForCausalLM(hf_config, backend)
    state: dict[str, torch.Tensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    for f in files:
        state.update(load_file(f))
    if "lm_head.weight" not in state and getattr(hf_config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the model: missing={missing} unexpected={unexpected}"
        )
    return model.to(device=device, dtype=dtype).eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.backend = get_attention_backend(
            config.attention_backend, self.device.type, config.block_size, self.dtype
        )
        logger.info("attention backend: %s", self.backend.name)
        torch.manual_seed(config.seed)
        self.model = load_model(model_dir, hf_config, self.backend, self.dtype, self.device)
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_blocks = self._measure_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.sampler = Sampler(self.device)
        self.decode_graphs = DecodeCudaGraphs.build(self)  # None: eager (CPU, --enforce-eager)

    # ---- KV cache ----------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _measure_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        budget = cfg.kv_cache_memory_bytes or self._default_kv_budget()
        # More than every sequence at full length is never useful.
        cap = cfg.max_num_seqs * cdiv(cfg.max_model_len, self.block_size)
        return max(1, min(budget // self._bytes_per_block(), cap))

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return max(0, int(total * self.config.gpu_memory_utilization) - used)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        kw = dict(dtype=self.dtype, device=self.device)
        return [
            (torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(self.num_layers)
        ]

    # ---- one step ----------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """Flatten the batch: ids, positions, slot mapping, block table, logits rows."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        logits_rows, sample_idx = [], []  # flat row of each sampled token, its request index
        max_blocks = max(len(b) for b in out.block_ids)
        block_table = np.zeros((len(out.requests), max_blocks), dtype=np.int32)
        num_rows = 0
        for i, (req, n, start) in enumerate(
            zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        ):
            ids = np.asarray(out.block_ids[i], dtype=np.int64)
            block_table[i, : len(ids)] = ids
            pos = np.arange(start, start + n)
            input_ids.append(np.asarray(req.all_token_ids[start : start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(ids[pos // bs] * bs + pos % bs)
            num_rows += n
            if start + n == req.num_tokens:  # reached the newest token: sample after it
                logits_rows.append(num_rows - 1)
                sample_idx.append(i)
            query_lens.append(n)
            seq_lens.append(start + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        ids_t = torch.from_numpy(np.concatenate(input_ids)).to(dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return ids_t, pos_t, meta, logits_rows, sample_idx

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One sampled token per scheduled request; None for a partial prefill chunk."""
        input_ids, positions, meta, logits_rows, sample_idx = self.prepare_inputs(out)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(meta):
            hidden = graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        sampled: list[int | None] = [None] * len(out.requests)
        result = ModelRunnerOutput(sampled_token_ids=sampled)
        if logits_rows:
            logits = self.model.compute_logits(hidden[logits_rows])
            sampler_out = self.sampler(logits, [out.requests[i] for i in sample_idx])
            for i, tok in zip(sample_idx, sampler_out.sampled_token_ids):
                sampled[i] = tok
            result.logprobs = sampler_out.logprobs
        result.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, out)
        return result

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
