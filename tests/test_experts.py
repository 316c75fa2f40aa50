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


def _amx_ops():
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None or not ops.amx_available():
        pytest.skip("the C++ expert kernel needs the CPU kernels with AMX")
    return ops


def _bf16_layer(num_experts: int, hidden: int, inter: int, gen) -> Experts:
    layer = Experts(num_experts, hidden, inter)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return layer.to(torch.bfloat16)


def amx_index_add_reference(ops, gate_up, down, x, expert_ids, weights):
    """index_add_reference with each expert's GEMMs on the AMX linear the kernel calls."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tokens, slot = torch.where(expert_ids == e)
        if len(tokens):
            gu = x.new_empty(len(tokens), gate_up[e].shape[0])
            ops.amx_linear(gu, x[tokens].contiguous(), ops.amx_pack_weight(gate_up[e]))
            act = x.new_empty(len(tokens), gate_up[e].shape[0] // 2)
            ops.silu_and_mul(act, gu)
            y = x.new_empty(len(tokens), x.shape[1])
            ops.amx_linear(y, act, ops.amx_pack_weight(down[e]))
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_cpu_kernel_adds_terms_as_index_add_does(num_tokens, top_k):
    """moe_experts (pagedserve_kernels/csrc/experts.cpp): the same bits as a per-expert index_add_
    over the same AMX linears, and within bf16 rounding of the float32 oracle."""
    ops = _amx_ops()
    gen = torch.Generator().manual_seed(10 * top_k + num_tokens)
    layer = _bf16_layer(8, 64, 32, gen)
    gate_up, down = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
    oracle = Experts(8, 64, 32)
    oracle.load_state_dict({"gate_up_proj": gate_up.float(), "down_proj": down.float()})
    x = torch.randn(num_tokens, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, 8, generator=gen)
    logits[:, 7] = -1e9  # expert 7 never chosen
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = weights.to(torch.bfloat16)
    layer.select(ops)
    assert layer.impl == "cpu" and layer.gate_up_proj is None  # packed copies only
    with torch.no_grad():
        got = layer(x, ids, weights)
        want = amx_index_add_reference(ops, gate_up, down, x, ids, weights)
        assert torch.equal(got, want)
        exact = oracle.forward_native(x.float(), ids, weights.float())
    torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=0.05)


def test_cpu_kernel_never_runs_an_expert_without_tokens():
    """An expert no token chose is never read: NaN weights there leave the output unchanged."""
    ops = _amx_ops()
    gen = torch.Generator().manual_seed(3)
    layer = _bf16_layer(8, 64, 32, gen)
    with torch.no_grad():
        clean = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
        layer.gate_up_proj[5] = float("nan")
        layer.down_proj[5] = float("nan")
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 6], [7, 0], [1, 2], [3, 4]])
    weights = torch.full((6, 2), 0.5, dtype=torch.bfloat16)
    layer.select(ops)
    with torch.no_grad():
        got = layer(x, ids, weights)
        assert torch.equal(got, amx_index_add_reference(ops, *clean, x, ids, weights))
    assert torch.isfinite(got).all()


def test_experts_stay_on_the_oracle_where_the_kernel_does_not_fit():
    ops = _amx_ops()
    assert Experts(4, 64, 32).choose(ops) == "native"  # float32
    assert Experts(4, 64, 24).to(torch.bfloat16).choose(ops) == "native"  # I not a multiple of 32
    assert Experts(4, 64, 32).to(torch.bfloat16).choose(ops) == "cpu"
