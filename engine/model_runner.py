"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.fused_decode import FusedDecode
from engine.kv_cache_manager import cdiv
from engine.layers import select_impls
from engine.layers.quantization import describe_quantized, mark_quantized
from engine.logprobs import compute_prompt_logprobs
from engine.models import check_model_config, get_model_class
from engine.outputs import ModelRunnerOutput
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.weight_loader import load_checked
from kernels import AttentionMetadata, get_attention_backend
from kernels.cpu_ops import load_cpu_ops

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


def load_model(
    model_dir: Path, hf_config, backend, dtype, device, quantization: str | None = None
) -> nn.Module:
    """Weights in, then every layer picks its implementation once: on CPU the C++ kernels (when
    they build) and packed bf16 linears, elsewhere the torch oracles; with a quantization the
    decoder linears quantize (engine/layers/quantization.py) and drop their float weights."""
    model = get_model_class(hf_config)(hf_config, backend)
    load_checked(model, model_dir)  # ValueError naming the file and tensor that do not fit
    model = model.to(device=device, dtype=dtype).eval()
    mark_quantized(model, quantization)
    select_impls(model, load_cpu_ops() if device.type == "cpu" else None)
    if quantization is not None:
        logger.info("%s", describe_quantized(model))
    return model


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
        if self.device.type == "cpu":
            _set_cpu_threads()
        torch.manual_seed(config.seed)
        check_model_config(hf_config, config.max_model_len)  # one line, before any weight is read
        self.model = load_model(
            model_dir, hf_config, self.backend, self.dtype, self.device, config.quantization
        )
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_blocks = self._measure_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.sampler = Sampler(self.device, load_cpu_ops() if self.device.type == "cpu" else None)
        self._allocate_input_buffers()
        self.decode_graphs = DecodeCudaGraphs.build(self)  # None: eager (CPU, --enforce-eager)
        self.fused_decode = FusedDecode.build(self.model, self.backend)  # None: layer by layer

    def _allocate_input_buffers(self) -> None:
        """Host buffers reused every step, sized for the largest possible batch."""
        n = self.config.max_num_batched_tokens
        self._arange = np.arange(n, dtype=np.int64)
        self._input_ids = np.zeros(n, dtype=np.int64)
        self._positions = np.zeros(n, dtype=np.int64)
        self._slot_mapping = np.zeros(n, dtype=np.int64)
        self.block_tables = BlockTables(cdiv(self.config.max_model_len, self.block_size))

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
        """Flatten the batch: ids, positions, slot mapping, block table, logits rows.

        Every array op is vectorized over the batch; each request's block-table row persists
        across steps and only the block ids the scheduler allocated this step are copied in.
        """
        bs, n_reqs = self.block_size, len(out.requests)
        query_lens = np.fromiter(out.num_scheduled_tokens, dtype=np.int64, count=n_reqs)
        starts = np.fromiter(out.num_computed_tokens, dtype=np.int64, count=n_reqs)
        seq_lens = starts + query_lens
        cu_q = np.cumsum(query_lens)
        num_tokens = int(cu_q[-1])
        rows = self.block_tables.update(out)
        # Per token: its request's row and its absolute position.
        row_of_token = np.repeat(rows, query_lens)
        positions = self._positions[:num_tokens]
        np.subtract(
            self._arange[:num_tokens],
            np.repeat(cu_q - query_lens - starts, query_lens),
            out=positions,
        )
        slots = self._slot_mapping[:num_tokens]
        table = self.block_tables.table
        np.add(table[row_of_token, positions // bs] * bs, positions % bs, out=slots)
        input_ids = self._input_ids[:num_tokens]
        input_ids[:] = _gather_token_ids(out)
        # Sample after a request's newest token; partial prefill chunks sample nothing.
        sampled_mask = seq_lens == np.fromiter(
            (r.num_tokens for r in out.requests), dtype=np.int64, count=n_reqs
        )
        sample_idx = np.flatnonzero(sampled_mask).tolist()
        logits_rows = (cu_q[sampled_mask] - 1).tolist()
        max_blocks = int((seq_lens.max() + bs - 1) // bs)
        block_table = table[rows, :max_blocks]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu_q)).astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            decode_shared_blocks=shared_prefix_blocks(block_table, query_lens, seq_lens, bs),
        )
        ids_t = torch.from_numpy(input_ids).to(dev)
        pos_t = torch.from_numpy(positions).to(dev)
        return ids_t, pos_t, meta, logits_rows, sample_idx

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One sampled token per scheduled request; None for a partial prefill chunk."""
        for request_id in out.finished_req_ids:  # the scheduler's word drives cleanup
            self.release(request_id)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids=[])
        input_ids, positions, meta, logits_rows, sample_idx = self.prepare_inputs(out)
        graphs = self.decode_graphs
        fused = self.fused_decode
        if graphs is not None and graphs.can_run(meta):
            hidden = graphs.run(input_ids, positions, meta)
        elif fused is not None and fused.can_run(meta):
            hidden = fused.run(input_ids, positions, meta, self.kv_caches)
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
        """Drops a finished request's sampler state and block-table row (from finished_req_ids)."""
        self.sampler.release(request_id)
        self.block_tables.release(request_id)


def _set_cpu_threads() -> None:
    """One intra-op thread per core this process may run on (taskset/cgroups), unless set."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def shared_prefix_blocks(
    table: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> int:
    """How many leading block ids all decoding rows (query length 1) of `table` have in common,
    counting only blocks before each one's newest token; 0 unless two or more decode."""
    decoding = query_lens == 1
    if np.count_nonzero(decoding) < 2:
        return 0
    limit = int((seq_lens[decoding] - 1).min()) // block_size
    rows = table[decoding, :limit]
    same = (rows == rows[0]).all(axis=0)
    return limit if same.all() else int(same.argmin())


def _gather_token_ids(out: SchedulerOutput) -> list[int]:
    """The scheduled tokens of every request, flattened in batch order."""
    ids: list[int] = []
    for req, n, start in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
        if n == 1:  # decode: the newest token
            ids.append(req.all_token_ids[start])
        else:
            ids.extend(req.all_token_ids[start : start + n])
    return ids


class BlockTables:
    """Per-request block-table rows, owned by the runner and edited only by the scheduler's deltas.

    A request keeps its row from its first step until the scheduler reports it finished. Each
    step appends the block ids allocated for it (SchedulerOutput.new_block_ids); a reset
    (first admission, readmission after preemption) rewrites the row from those ids.
    """

    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.num_filled: dict[str, int] = {}

    def update(self, out: SchedulerOutput) -> np.ndarray:  # [num_reqs] row of each request
        rows = np.empty(len(out.requests), dtype=np.int64)
        row_of, num_filled = self.row_of, self.num_filled
        for i, (req, new_ids, reset) in enumerate(
            zip(out.requests, out.new_block_ids, out.block_table_reset)
        ):
            rid = req.request_id
            row = row_of.get(rid)
            if row is None:
                row = row_of[rid] = self._take_row()
                num_filled[rid] = 0
            elif reset:
                num_filled[rid] = 0
            if new_ids:
                filled = num_filled[rid]
                self.table[row, filled : filled + len(new_ids)] = new_ids
                num_filled[rid] = filled + len(new_ids)
            rows[i] = row
        return rows

    def _take_row(self) -> int:
        if not self.free_rows:  # more live requests than rows: double the table
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
        self.num_filled.pop(request_id, None)
