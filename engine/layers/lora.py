"""LoRA on a linear, batched over adapters: one shrink and one expand per linear per step.

Every adapter slot s (0..S-1, --max-loras of them) holds, for a linear whose output stacks P
parts (q/k/v: 3, gate/up: 2, o and down: 1), its A matrices in rows [s*P*r, (s+1)*P*r) of
A_all [S*P*r, in] and its B matrices, transposed, in the same rows of Bt_all [S*P*r, out]
(block-diagonal: row s*P*r + p*r + j is non-zero only over part p's outputs; r:
--max-lora-rank, a smaller rank is zero-padded). A step's tokens each use one slot or none (the
base model). Three paths, tested equal:

- the kernel (`lora_add`, pagedserve_kernels/csrc/lora.cpp, on CPU with the kernels built):
  per token, its slot's shrink and expand in float32, added to the base output in place; base
  tokens cost nothing. One call per linear, no allocation of stacks per step.
- the torch path: with M [T, n*P*r] holding the token's slot's scaling in that slot's columns,
      y = base(x) + ((x @ A_all[:n*P*r]^T) * M) @ Bt_all[:n*P*r]
  two GEMMs over the n slots in use for the whole batch (Punica's BGMV as dense GEMMs: no
  gather, no loop over requests); with one adapter in the step, only its tokens' rows.
- `lora_delta_native`, the oracle: the per-token gather + bmm (BGMV) over the same slots.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """The step's per-token slot assignment, shared by every LoRA linear of the model.

    active is False for a base-only batch: the linears then run the base path alone.
    """

    def __init__(self, num_slots: int, max_rank: int, dtype, device, ops=None) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.ops = ops  # torch.ops.pagedserve_cpu (its lora_add); None: the torch path
        self.active = False
        self.num_active = 0  # slots 0..num_active-1 cover every token's: the GEMMs use those
        self.token_slots: torch.Tensor | None = None  # [T] int64, -1: the base model
        self.slot_scaling: torch.Tensor | None = None  # [S] float32
        self.rows: torch.Tensor | None = None  # one slot, some base tokens: the slot's tokens
        self._masks: dict[int, torch.Tensor] = {}

    def set(
        self,
        token_slots: torch.Tensor | None,
        slot_scaling: torch.Tensor | None,
        num_active: int | None = None,
    ) -> None:
        """token_slots [T] (-1 for base tokens) and slot_scaling [S], or None for base only;
        num_active: 1 + the highest slot of token_slots, when the caller knows it (no sync)."""
        self._masks = {}
        self.active = token_slots is not None
        self.token_slots, self.rows = token_slots, None
        if token_slots is None:
            self.slot_scaling = None
            return
        self.slot_scaling = slot_scaling.float().contiguous()
        n = int(token_slots.max()) + 1 if num_active is None else num_active
        self.num_active = n
        if self.ops is None and n == 1:
            rows = (token_slots == 0).nonzero().squeeze(1)
            self.rows = rows if len(rows) < len(token_slots) else None

    def token_scaling(self) -> torch.Tensor:
        """Each token's adapter scaling, 0 for base tokens."""
        w = self.slot_scaling[self.token_slots.clamp(min=0)]
        return torch.where(self.token_slots >= 0, w, torch.zeros_like(w))

    def mask(self, parts: int) -> torch.Tensor:
        """M [T, n*parts*r] for a linear of `parts` stacked outputs, n the step's active slots
        (built once per step)."""
        m = self._masks.get(parts)
        if m is None:
            n = self.num_active
            onehot = self.token_slots.unsqueeze(1) == torch.arange(n, device=self.device)
            w = onehot.to(self.dtype) * self.slot_scaling[:n].to(self.dtype)  # [T, n]
            width = parts * self.max_rank
            m = w.unsqueeze(2).expand(w.shape[0], n, width).reshape(w.shape[0], -1)
            self._masks[parts] = m
        return m


class LoRALinearWeights(nn.Module):
    """The stacked adapter weights of one linear (its base stays where it is, untouched)."""

    def __init__(
        self, in_features: int, part_sizes: list[int], batch: LoRABatch, dtype, device
    ) -> None:
        super().__init__()
        self.batch = batch
        self.part_sizes = list(part_sizes)
        self.parts = len(part_sizes)
        s, r = batch.num_slots, batch.max_rank
        cols = s * self.parts * r
        self.in_features, self.out_features = in_features, sum(part_sizes)
        self.register_buffer("a_all", torch.zeros(cols, in_features, dtype=dtype, device=device))
        self.register_buffer(
            "bt_all", torch.zeros(cols, self.out_features, dtype=dtype, device=device)
        )

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (A [r, in], B [out_part, r]) per part (None: not targeted)."""
        r = self.batch.max_rank
        base_col = slot * self.parts * r
        cols = slice(base_col, base_col + self.parts * r)
        self.a_all[cols].zero_()
        self.bt_all[cols].zero_()
        row = 0
        for p, (size, ab) in enumerate(zip(self.part_sizes, parts)):
            if ab is not None:
                a, b = ab
                c0 = base_col + p * r
                self.a_all[c0 : c0 + a.shape[0]] = a.to(self.a_all.dtype)
                self.bt_all[c0 : c0 + b.shape[1], row : row + size] = b.t().to(self.bt_all.dtype)
            row += size

    def grow(self, extra_slots: int) -> None:
        """Appends zeroed slots (the layout is slot-major: new columns go at the end)."""
        cols = extra_slots * self.parts * self.batch.max_rank
        self.a_all = torch.cat([self.a_all, self.a_all.new_zeros(cols, self.in_features)])
        self.bt_all = torch.cat([self.bt_all, self.bt_all.new_zeros(cols, self.out_features)])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution for every token of the batch (the torch path): one
        shrink, one expand."""
        cols = self.batch.num_active * self.parts * self.batch.max_rank
        shrunk = torch.mm(x, self.a_all[:cols].t()) * self.batch.mask(self.parts)  # [T, n*P*r]
        return torch.mm(shrunk, self.bt_all[:cols])  # [T, out]

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base output) plus the adapters' contribution: the kernel in place where it
        runs, else the torch path (over the adapter's rows alone when one adapter is in use)."""
        batch = self.batch
        if batch.ops is not None and y.stride(-1) == 1 and x.stride(-1) == 1:
            batch.ops.lora_add(
                y, x, self.a_all, self.bt_all, batch.token_slots, batch.slot_scaling,
                self.part_sizes, batch.max_rank,
            )  # fmt: skip
            return y
        rows = batch.rows
        if rows is None:
            return y + self.delta(x)
        r = batch.max_rank * self.parts
        shrunk = torch.mm(x.index_select(0, rows), self.a_all[:r].t()) * batch.slot_scaling[0]
        return y.index_add(0, rows, torch.mm(shrunk.to(y.dtype), self.bt_all[:r]))


def lora_delta_native(weights: LoRALinearWeights, x: torch.Tensor) -> torch.Tensor:
    """The oracle: per token, gather its slot's A and B and apply them (BGMV), scaled."""
    batch = weights.batch
    s, r, p = batch.num_slots, batch.max_rank, weights.parts
    slots = batch.token_slots
    a = weights.a_all.view(s, p * r, -1)  # [S, P*r, in]
    b = weights.bt_all.view(s, p * r, -1).transpose(1, 2)  # [S, out, P*r]
    scale = batch.token_scaling()  # [T]
    idx = slots.clamp(min=0)
    shrunk = torch.bmm(a[idx], x.unsqueeze(2))  # [T, P*r, 1]
    out = torch.bmm(b[idx], shrunk).squeeze(2)  # [T, out]
    return out * scale.unsqueeze(1)


def wrap_lora(linear: nn.Module, weights: LoRALinearWeights) -> None:
    """Adds the adapters to `linear`'s bound forward (whatever implementation select() chose:
    packed bf16, int8, GGUF or the oracle), as the child module `lora`. A base-only batch runs
    the base forward and one attribute test."""
    base_forward = linear.forward
    batch = weights.batch
    linear.lora = weights

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base_forward(x)
        return weights.add_to(y, x) if batch.active else y

    linear.forward = forward
