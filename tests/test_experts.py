"""The expert layer's grouped dispatch adds each token's terms as a per-expert index_add_ does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.experts import Experts


def index_add_reference(layer, x, expert_ids, weights):
    """transformers' loop: per expert, its tokens' outputs index_add_-ed in expert order."""
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        tokens, slot = torch.where(expert_ids == e)
        if len(tokens):
            gate, up = F.linear(x[tokens], layer.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.down_proj[e])
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_grouped_dispatch_is_bit_identical_to_index_add(dtype, top_k):
    gen = torch.Generator().manual_seed(top_k)
    layer = Experts(8, 32, 16)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    layer = layer.to(dtype)
    x = torch.randn(37, 32, generator=gen).to(dtype)
    logits = torch.randn(37, 8, generator=gen)
    logits[:, 7] = -1e9  # expert 7 never chosen: it must cost nothing and add nothing
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = weights.to(dtype)
    with torch.no_grad():
        got = layer.forward_native(x, ids, weights)
        assert torch.equal(got, index_add_reference(layer, x, ids, weights))
