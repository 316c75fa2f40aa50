"""CUDA graphs for decode batches: one graph per batch-size bucket over static input buffers.

A decode step launches hundreds of small kernels; replaying a captured graph removes the CPU
launch cost that dominates small batches. Inputs are copied into static buffers, the batch is
padded up to the nearest bucket, and padding rows get slot -1 (their KV write is skipped) and
seq_len 1 (they read one cached token and are thrown away).

    buffers   | real rows 0..B-1 | padding rows B..bucket-1 (slot -1, seq_len 1) |

Only backends whose kernels are capture-safe (no host syncs, grids fixed by the batch size,
KV writes that skip slot -1) opt in, declaring `supports_cuda_graphs`
(pagedserve_kernels/backend.py).
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve_kernels import AttentionMetadata

logger = logging.getLogger(__name__)

_MAX_CAPTURED_BATCH = 512


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (rounded up), at most 512."""
    top = min(max_num_seqs, _MAX_CAPTURED_BATCH)
    buckets = [b for b in (1, 2, 4, 8) if b < top]
    buckets += list(range(16, top + 16, 16)) if top > 8 else [top]
    return sorted({b for b in buckets if b < top + 16})


class DecodeCudaGraphs:
    def __init__(self, runner, buckets: list[int], max_num_blocks: int) -> None:
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.block_size = runner.block_size
        self.buckets = buckets
        self.max_num_blocks = max_num_blocks
        n, dev = buckets[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(n, max_num_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def build(cls, runner) -> DecodeCudaGraphs | None:
        cfg = runner.config
        if runner.device.type != "cuda" or cfg.enforce_eager:
            return None
        if not runner.backend.supports_cuda_graphs:
            logger.info("CUDA graphs off: backend %s is not capture-safe", runner.backend.name)
            return None
        max_num_blocks = -(cfg.max_model_len // -runner.block_size)
        graphs = cls(runner, batch_size_buckets(cfg.max_num_seqs), max_num_blocks)
        graphs.capture()
        return graphs

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch],
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[self.max_num_blocks * self.block_size] * batch,
            max_query_len=1,
            max_seq_len=self.max_num_blocks * self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):  # largest first, smaller graphs reuse its pool
            self.graphs[batch] = self._capture_one(batch, pool)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            self.buckets,
            time.monotonic() - t0,
        )

    def _capture_one(self, batch: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.input_ids[:batch], self.positions[:batch], self._meta(batch), self.kv_caches)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(*args)
        return graph, hidden

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            meta.is_decode_only
            and meta.num_seqs <= self.buckets[-1]
            and meta.block_table.shape[1] <= self.max_num_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # hidden [num_seqs, hidden_size], valid until the next replay
        n = meta.num_seqs
        batch = next(b for b in self.buckets if b >= n)
        width = meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:batch].fill_(1)
        self.block_table[:n, :width].copy_(meta.block_table)
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[:n]
