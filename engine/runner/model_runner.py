"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheSpec, max_blocks_per_request, plan_kv_groups
from engine.core.kv_cache_manager import cdiv
from engine.core.scheduler import SchedulerOutput
from engine.distributed import get_tp, min_across_ranks
from engine.dtype import resolve_dtype
from engine.layers import Attention, GroupedAttentionMetadata, select_impls
from engine.layers.quantization.apply import describe_quantized, mark_quantized
from engine.lora.manager import LoRAManager
from engine.model_loader.weight_loader import load_checked
from engine.models import check_model_config, get_model_class
from engine.multimodal.embedder import MultiModalEmbedder
from engine.multimodal.mrope import MRopePositions
from engine.outputs import ModelRunnerOutput
from engine.runner.block_copy import copy_blocks
from engine.runner.cuda_graphs import DecodeCudaGraphs
from engine.runner.fused_decode import FusedDecode
from engine.sample.logprobs import compute_prompt_logprobs
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler
from pagedserve_kernels import AttentionMetadata, get_attention_backend
from pagedserve_kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(
    model_dir: Path, hf_config, backend, dtype, device, quantization: str | None = None,
    gguf_weights: str = "auto",
) -> nn.Module:
    """Weights in, then every layer picks its implementation once: on CPU the C++ kernels (when
    they build) and packed bf16 linears, elsewhere the torch oracles; with a quantization the
    decoder linears quantize (engine/layers/quantization/int8.py) and drop their float weights."""
    model = get_model_class(hf_config)(hf_config, backend)
    load_checked(model, model_dir)  # ValueError naming the file and tensor that do not fit
    model = model.to(device=device, dtype=dtype).eval()
    # GGUF blocks: quantization/apply (--gguf-weights)
    marked = mark_quantized(model, quantization, model_dir, gguf_weights)
    select_impls(model, load_cpu_ops() if device.type == "cpu" else None)
    if marked:
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
        if self.device.type == "cpu":
            _set_cpu_threads()
        torch.manual_seed(config.seed)
        check_model_config(hf_config, config.max_model_len)  # one line, before any weight is read
        self.model = self._load_model(model_dir, hf_config)  # a pooling runner's loads its way
        # LoRA: adapters added to the decoder linears, a per-token adapter index each step
        self.lora = (
            LoRAManager(self.model, config, self.dtype, self.device) if config.enable_lora else None
        )
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # this rank's heads
        self.tp = get_tp()
        self.kv_cache_spec = self._plan_kv_cache_groups()
        # Every rank's cache holds its KV heads with the same block tables: one pool size.
        self.num_blocks = min_across_ranks(self._measure_num_blocks())
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.kv_cache_bytes = self.num_blocks * self._bytes_per_block()  # this rank's
        self.sampler = Sampler(self.device, load_cpu_ops() if self.device.type == "cpu" else None)
        self.rejection_sampler = RejectionSampler(self.sampler)  # drafts: verify
        self._allocate_input_buffers()
        # images merged into the input embeddings (None: a text-only model)
        self.mm = MultiModalEmbedder.build(self.model, config.mm_encoder_cache_bytes, self.device)
        self.mrope = MRopePositions.build(self.model)  # (t, h, w) positions: Qwen2.5-VL
        self.decode_graphs = self.fused_decode = None
        self.kv_offload = None  # the second KV tier's hook (engine/kv_offload/), set by the engine
        # Neither the graphs nor the fused decode step know the row-parallel all-reduces,
        # windows or logit caps.
        if self._plain_attention and self.tp.world_size == 1:
            self.decode_graphs = DecodeCudaGraphs.build(self)  # None: eager (CPU, enforce_eager)
            self.fused_decode = FusedDecode.build(self.model, self.backend)  # None: per layer
        if not self._plain_attention:
            logger.info("KV cache groups (window per group): %s", self.kv_cache_spec.windows)

    def _load_model(self, model_dir: Path, hf_config) -> nn.Module:
        cfg, dev = self.config, self.device
        args = (self.backend, self.dtype, dev, cfg.quantization, cfg.gguf_weights)
        return load_model(model_dir, hf_config, *args)

    def _allocate_input_buffers(self) -> None:
        """Host buffers reused every step, sized for the largest possible batch."""
        n = self.config.max_num_batched_tokens
        self._arange = np.arange(n, dtype=np.int64)
        self._input_ids = np.zeros(n, dtype=np.int64)
        self._positions = np.zeros(n, dtype=np.int64)
        self._slot_mapping = np.zeros(n, dtype=np.int64)
        max_blocks = cdiv(self.config.max_model_len, self.block_size)
        self.block_tables = BlockTables(max_blocks)  # group 0's
        self.group_block_tables = [
            BlockTables(max_blocks) for _ in range(1, self.kv_cache_spec.num_groups)
        ]

    # ---- KV cache groups ---------------------------------------------------------------------
    def _plan_kv_cache_groups(self) -> KVCacheSpec:
        """Groups the layers by window, tells each layer its group, and checks the backend.

        A window no shorter than max_model_len never hides a token: such layers attend fully.
        """
        attns = [_attention_of(layer) for layer in self.model.model.layers]
        for attn in attns:
            if attn.window >= self.config.max_model_len:
                attn.window = 0
        for flag, what in (("supports_sliding_window", "window"), ("supports_softcap", "softcap")):
            if any(getattr(a, what) for a in attns) and not getattr(self.backend, flag):
                raise ValueError(
                    f"attention backend {self.backend.name} has no {what} support, which this "
                    f"model's layers need; choose another with --attention-backend"
                )
        self._plain_attention = not any(a.window or a.softcap for a in attns)
        spec = plan_kv_groups([a.window for a in attns])
        for layer, (group, _) in spec.group_and_slot().items():
            attns[layer].kv_group = group
        return spec

    # ---- KV cache ----------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        num_slots = self.kv_cache_spec.num_slots  # one layer of every group shares a slot
        return 2 * num_slots * self.block_size * self.num_kv_heads * self.head_dim * elem

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """Most blocks one request of num_tokens KV tokens holds at once, over all groups."""
        cfg = self.config
        windows = self.kv_cache_spec.windows
        return max_blocks_per_request(
            windows, self.block_size, num_tokens, cfg.max_num_batched_tokens
        )

    def _measure_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        budget = cfg.kv_cache_memory_bytes or self._default_kv_budget()
        # More than every sequence at full length is never useful.
        cap = cfg.max_num_seqs * self.max_blocks_per_request(cfg.max_model_len)
        return max(1, min(budget // self._bytes_per_block(), cap))

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return max(0, int(total * self.config.gpu_memory_utilization) - used)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (K, V) pair per layer slot; each layer gets its slot's pair (the same tensors
        for the layers of different groups in one slot: a block belongs to one group at once)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        kw = dict(dtype=self.dtype, device=self.device)
        slots = [
            (torch.zeros(shape, **kw), torch.zeros(shape, **kw))
            for _ in range(self.kv_cache_spec.num_slots)
        ]
        placement = self.kv_cache_spec.group_and_slot()
        return [slots[placement[layer][1]] for layer in range(self.num_layers)]

    # ---- one step ----------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """Flatten the batch: ids, positions, slot mapping, block table, logits rows.

        Every array op is vectorized over the batch; each request's block-table row persists
        across steps and only the block ids the scheduler allocated this step are copied in.
        """
        n_reqs = len(out.requests)
        query_lens = np.fromiter(out.num_scheduled_tokens, dtype=np.int64, count=n_reqs)
        starts = np.fromiter(out.num_computed_tokens, dtype=np.int64, count=n_reqs)
        seq_lens = starts + query_lens
        cu_q = np.cumsum(query_lens)
        rows = self.block_tables.update(out)
        positions, slots, input_ids = self._token_inputs(out, rows, query_lens, starts, cu_q)
        logits_rows, sample_idx = _logits_rows(out, cu_q, seq_lens)
        max_blocks = int((seq_lens.max() + self.block_size - 1) // self.block_size)
        meta = self._attention_metadata(rows, slots, query_lens, seq_lens, cu_q, max_blocks)
        if self.group_block_tables:
            meta = self._grouped_metadata(out, meta, positions, max_blocks)
        dev = self.device
        ids_t = torch.from_numpy(input_ids).to(dev)
        rope_pos = positions if self.mrope is None else self.mrope.positions(out, positions)
        pos_t = torch.from_numpy(rope_pos).to(dev)
        return ids_t, pos_t, meta, logits_rows, sample_idx

    def _token_inputs(self, out: SchedulerOutput, rows, query_lens, starts, cu_q):
        """Per token, in the persistent buffers: absolute position, KV slot, token id."""
        bs, num_tokens = self.block_size, int(cu_q[-1])
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
        return positions, slots, input_ids

    def _attention_metadata(self, rows, slots, query_lens, seq_lens, cu_q, max_blocks: int):
        """Group 0's attention metadata, its tensors on the device."""
        bs, dev = self.block_size, self.device
        block_table = self.block_tables.table[rows, :max_blocks]
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu_q)).astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            # placeholders of slid-out blocks look shared: sliding groups take no cascade
            decode_shared_blocks=0
            if self.kv_cache_spec.windows[0]
            else shared_prefix_blocks(block_table, query_lens, seq_lens, bs),
        )

    def _grouped_metadata(self, out, meta, positions, max_blocks: int):
        """Group 0's metadata plus one per other group: its own slots and block table."""
        bs, dev = self.block_size, self.device
        query_lens = np.asarray(meta.query_lens_cpu, dtype=np.int64)
        grouped = GroupedAttentionMetadata(**{f: getattr(meta, f) for f in _META_FIELDS})
        grouped.groups.append(grouped)
        for g, tables in enumerate(self.group_block_tables, start=1):
            deltas = [d[g - 1] for d in out.group_new_block_ids]
            rows = tables.update(out, deltas)
            row_of_token = np.repeat(rows, query_lens)
            table = tables.table
            slots = table[row_of_token, positions // bs] * bs + positions % bs
            block_table = table[rows, :max_blocks]
            shared = 0
            if self.kv_cache_spec.windows[g] == 0:
                shared = shared_prefix_blocks(
                    block_table, query_lens, np.asarray(meta.seq_lens_cpu), bs
                )
            grouped.groups.append(
                AttentionMetadata(
                    slot_mapping=torch.from_numpy(slots).to(dev),
                    query_start_loc=meta.query_start_loc,
                    seq_lens=meta.seq_lens,
                    block_table=torch.from_numpy(block_table).to(dev),
                    query_lens_cpu=meta.query_lens_cpu,
                    seq_lens_cpu=meta.seq_lens_cpu,
                    max_query_len=meta.max_query_len,
                    max_seq_len=meta.max_seq_len,
                    decode_shared_blocks=shared,
                )
            )
        return grouped

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One sampled token per scheduled request; None for a partial prefill chunk."""
        for request_id in out.finished_req_ids:  # the scheduler's word drives cleanup
            self.release(request_id)
        if self.kv_offload is not None:  # tier stores and loads, before anything writes KV
            self.kv_offload.step(out)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids=[])
        if out.block_copies:  # copy-on-write after a fork: before anything writes KV
            copy_blocks(self.kv_caches, out.block_copies)
        input_ids, positions, meta, logits_rows, sample_idx = self.prepare_inputs(out)
        hidden = self._forward(out, input_ids, positions, meta)
        sampled: list[int | None] = [None] * len(out.requests)
        result = ModelRunnerOutput(sampled_token_ids=sampled)
        if logits_rows:
            logits = self.model.compute_logits(hidden[logits_rows])  # a collective: every rank
            if not self.tp.is_driver:  # only rank 0 samples and answers
                compute_prompt_logprobs(self.model, hidden, out)
                return result
            if out.spec_token_ids:
                self._sample_with_drafts(out, logits, sample_idx, result)
            else:
                sampler_out = self.sampler(logits, [out.requests[i] for i in sample_idx])
                for i, tok in zip(sample_idx, sampler_out.sampled_token_ids):
                    sampled[i] = tok
                result.logprobs = sampler_out.logprobs
        result.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, out)
        return result

    def _forward(self, out: SchedulerOutput, input_ids, positions, meta) -> torch.Tensor:
        """The step's hidden states: through image embeddings, a CUDA graph, the fused decode
        step or the per-layer model, whichever applies first."""
        graphs = self.decode_graphs
        fused = self.fused_decode
        if self.lora is not None and self.lora.prepare(out.requests, out.num_scheduled_tokens):
            graphs, fused = None, self.lora.fused_step(fused)  # adapters: CPU fused step or none
        embeds = self.mm.inputs_embeds(out, input_ids) if self.mm is not None else None
        if embeds is not None:  # image placeholder tokens in this step: their embeddings
            return self.model(input_ids, positions, meta, self.kv_caches, inputs_embeds=embeds)
        if graphs is not None and graphs.can_run(meta):
            return graphs.run(input_ids, positions, meta)
        if fused is not None and fused.can_run(meta):
            return fused.run(input_ids, positions, meta, self.kv_caches)
        return self.model(input_ids, positions, meta, self.kv_caches)

    def _sample_with_drafts(
        self, out: SchedulerOutput, logits: torch.Tensor, sample_idx: list[int], result
    ) -> None:
        """Plain rows through the sampler as usual; requests with drafts through the rejection
        sampler (engine/sample/rejection_sampler.py)."""
        spec = out.spec_token_ids
        plain_rows, plain_idx, verify_rows, verify_idx = [], [], [], []
        row = 0
        for i in sample_idx:
            drafts = spec.get(out.requests[i].request_id)
            if drafts is None:
                plain_rows.append(row)
                plain_idx.append(i)
                row += 1
            else:
                verify_rows.extend(range(row, row + len(drafts) + 1))
                verify_idx.append(i)
                row += len(drafts) + 1
        sampled = result.sampled_token_ids
        if plain_idx:
            sampler_out = self.sampler(logits[plain_rows], [out.requests[i] for i in plain_idx])
            for i, tok in zip(plain_idx, sampler_out.sampled_token_ids):
                sampled[i] = tok
            result.logprobs = sampler_out.logprobs
        reqs = [out.requests[i] for i in verify_idx]
        verified = self.rejection_sampler.verify(
            logits[verify_rows], reqs, [spec[r.request_id] for r in reqs]
        )
        for i, req, tokens in zip(verify_idx, reqs, verified.token_ids):
            sampled[i] = tokens[-1]
            result.spec_token_ids[req.request_id] = tokens
        result.spec_logprobs = verified.logprobs

    def release(self, request_id: str) -> None:
        """Drops a finished request's sampler state and block-table row (from finished_req_ids)."""
        self.sampler.release(request_id)
        self.block_tables.release(request_id)
        for tables in self.group_block_tables:
            tables.release(request_id)


_META_FIELDS = [f.name for f in dataclasses.fields(AttentionMetadata)]


def _attention_of(layer: nn.Module) -> Attention:
    return next(m for m in layer.modules() if isinstance(m, Attention))


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


def _logits_rows(out: SchedulerOutput, cu_q, seq_lens) -> tuple[list[int], list[int]]:
    """Rows of the hidden states to turn into logits, and the requests that sample.

    A request samples after its newest token (and each of its drafts); partial prefill chunks
    sample nothing.
    """
    n_reqs = len(out.requests)
    spec = out.spec_token_ids
    num_drafts = np.fromiter(
        (len(spec.get(r.request_id, ())) for r in out.requests) if spec else (),
        dtype=np.int64,
        count=n_reqs if spec else 0,
    )
    ends = np.fromiter((r.num_tokens for r in out.requests), dtype=np.int64, count=n_reqs)
    sampled_mask = seq_lens == (ends + num_drafts if spec else ends)
    sample_idx = np.flatnonzero(sampled_mask).tolist()
    if spec:  # rows of the newest token and every draft: the last 1 + K of the chunk
        last = cu_q[sampled_mask]
        counts = num_drafts[sampled_mask] + 1
        logits_rows = (np.repeat(last - counts, counts) + _ranges(counts)).tolist()
    else:
        logits_rows = (cu_q[sampled_mask] - 1).tolist()
    return logits_rows, sample_idx


def _gather_token_ids(out: SchedulerOutput) -> list[int]:
    """The scheduled tokens of every request, flattened in batch order (drafts after the
    newest token)."""
    ids: list[int] = []
    spec = out.spec_token_ids
    for req, n, start in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
        if n == 1:  # decode: the newest token
            ids.append(req.all_token_ids[start])
        elif spec and req.request_id in spec:
            ids.append(req.all_token_ids[start])
            ids.extend(spec[req.request_id])
        else:
            ids.extend(req.all_token_ids[start : start + n])
    return ids


def _ranges(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each c in counts, concatenated."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts


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

    def update(
        self, out: SchedulerOutput, new_block_ids: list[tuple[int, ...]] | None = None
    ) -> np.ndarray:  # [num_reqs] row of each request
        """Applies the step's deltas: out.new_block_ids (group 0's), or new_block_ids given."""
        rows = np.empty(len(out.requests), dtype=np.int64)
        row_of, num_filled = self.row_of, self.num_filled
        deltas = out.new_block_ids if new_block_ids is None else new_block_ids
        for i, (req, new_ids, reset) in enumerate(zip(out.requests, deltas, out.block_table_reset)):
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
