"""Decode CUDA graphs: bucket choice and the static-buffer staging, checked on CPU.

Capture itself needs CUDA (tests/test_kernels.py has the gpu-marked replay-vs-eager test). Here
each bucket's "graph" is an eager call over the same static buffers, so padding rows (slot -1,
seq_len 1), stale block-table columns and bucket choice are exercised by the Triton kernels
under TRITON_INTERPRET=1 and compared with the torch backend's greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import make_prompts  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.runner.cuda_graphs import DecodeCudaGraphs, batch_size_buckets  # noqa: E402

pytest.importorskip("triton")


def test_buckets_cover_max_num_seqs():
    assert batch_size_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    assert batch_size_buckets(20)[-1] >= 20
    assert batch_size_buckets(4096)[-1] == 512


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay recomputes into the captured output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


def _install_eager_graphs(runner, buckets: list[int]) -> DecodeCudaGraphs:
    max_num_blocks = -(runner.config.max_model_len // -runner.block_size)
    graphs = DecodeCudaGraphs(runner, buckets, max_num_blocks)
    hidden_size = runner.model.config.hidden_size
    for b in buckets:
        args = (graphs.input_ids[:b], graphs.positions[:b], graphs._meta(b), graphs.kv_caches)
        out = torch.empty(b, hidden_size, dtype=runner.dtype)
        graphs.graphs[b] = (_EagerGraph(lambda a=args: runner.model(*a), out), out)
    runner.decode_graphs = graphs
    return graphs


def test_graph_staging_keeps_greedy_tokens(tiny_model_dir):
    prompts = make_prompts(3, seed=9, max_len=24)  # 3 sequences replay the padded bucket of 4
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=128, device="cpu")
    ref = LLM(str(tiny_model_dir), attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_model_dir), attention_backend="triton", **common)
    assert llm.engine.runner.decode_graphs is None  # never captured on CPU
    graphs = _install_eager_graphs(llm.engine.runner, [1, 2, 4])
    graphs.block_table.fill_(7)  # stale columns from "earlier batches" must not matter
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.graphs[4][0].replays == 4  # every decode step of the 3 sequences replayed
