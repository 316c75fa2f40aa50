"""Vocabulary-parallel embedding: each rank holds rows [rank * V/N, (rank + 1) * V/N) of the
table, looks up the ids that fall in its range, and one all-reduce sums the ranks' rows (every
id has exactly one owner, the others contribute zeros). ParallelLMHead is a column-parallel
linear over the same ranges whose logits are gathered."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_gather_last_dim, all_reduce, get_tp
from engine.layers.linear import ColumnParallelLinear, rank_rows, shard_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_rows = shard_size(num_embeddings, tp.world_size, "vocab_size")
        self.row_start = tp.rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, embedding_dim))
        nn.init.normal_(self.weight)  # nn.Embedding's init: the same draws from the seeded RNG

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.row_start
        foreign = (local < 0) | (local >= self.num_rows)  # ids another rank owns
        x = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return all_reduce(x.masked_fill_(foreign.unsqueeze(-1), 0.0))

    def load_shard(self, leaf: str, part: str | None, sl) -> torch.Tensor:
        return rank_rows(sl, self.row_start, sl.get_shape()[0] // self.tp_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from {self.row_start}"


class ParallelLMHead(ColumnParallelLinear):
    """Each rank's vocabulary rows of the output projection (tied: the embedding's own rows)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        # Gathered on every rank, not only rank 0: prompt-logprob scoring and the sampler's
        # input stay one code path on every rank (only rank 0 samples).
        return all_gather_last_dim(self(hidden))
