"""--gguf-weights {auto,packed,dense}: which weights a GGUF's linears run on, per call.

The dispatch is asserted through the layer (which module a call reaches), never by timing; the
served tokens of the default (auto) against the dense path with the criteria of
test_gguf_quant.py's packed-against-dequantized test."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_gguf_quant import _logprob_gaps, cache, random_blocks, tiny_gguf  # noqa: F401

from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.layers.quantization import gguf as gguf_quant
from engine.layers.quantization.gguf import GGUF_AUTO, GGUFDispatch, GGUFWeights, pack_parts
from server.cli import engine_config, parse_args

MAX_NEW = 6


def _marked_linear(dense: bool) -> Linear:
    torch.manual_seed(0)
    linear = Linear(256, 64).to(torch.bfloat16)
    linear.quantization = "gguf"
    linear.gguf_parts = pack_parts([("Q8_0", random_blocks("Q8_0", 64, 256, 1))])
    linear.gguf_dense = dense
    return linear


class _Counted:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


def _set_limit(monkeypatch, limit: int | None) -> None:
    """packed_max_rows() gives limit on any CPU (with or without AMX or VNNI)."""
    for name in ("PACKED_MAX_ROWS", "PACKED_MAX_ROWS_AMX", "PACKED_MAX_ROWS_PORTABLE"):
        monkeypatch.setattr(gguf_quant, name, limit)


@pytest.mark.parametrize("limit", [1, 4, 31, 40])
def test_auto_runs_packed_up_to_the_limit_and_dense_above(limit, ops, monkeypatch):
    _set_limit(monkeypatch, limit)
    linear = _marked_linear(dense=True)
    linear.select(ops)
    dispatch = linear.forward
    assert isinstance(dispatch, GGUFDispatch) and linear.impl == GGUF_AUTO
    assert dispatch.max_rows == limit and linear.weight is None
    assert isinstance(linear.quant, GGUFWeights) and linear.packed is not None
    # the dense copy has dense_linear's packing only where decode-sized calls reach it
    assert (linear.packed.amx is not None) == (limit < 32)
    dispatch.quant, dispatch.dense = _Counted(dispatch.quant), _Counted(dispatch.dense)
    for rows, want in ((1, "packed"), (limit, "packed"), (limit + 1, "dense"),
                       (limit + 300, "dense")):
        assert dispatch.weights_for(rows) == want
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        before = (dispatch.quant.calls, dispatch.dense.calls)
        got = linear(x)
        ran = "packed" if dispatch.quant.calls > before[0] else "dense"
        assert ran == want and dispatch.quant.calls + dispatch.dense.calls == sum(before) + 1
        ref = (linear.quant if want == "packed" else linear.packed.forward)(x)
        assert torch.equal(got, ref)
    three_d = torch.randn(2, limit, 256, dtype=torch.bfloat16)  # 2 x limit rows: dense
    before = dispatch.dense.calls
    assert linear(three_d).shape == (2, limit, 64) and dispatch.dense.calls == before + 1


def test_auto_without_a_limit_holds_no_dense_copy(ops, monkeypatch):
    """No crossover (the VNNI kernel without AMX, as measured): every call packed, no copy."""
    _set_limit(monkeypatch, None)
    linear = _marked_linear(dense=True)
    linear.select(ops)
    assert linear.packed is None and not isinstance(linear.forward, GGUFDispatch)
    assert linear.forward == linear.quant.forward


def test_packed_max_rows_follows_the_kernel(ops):
    want = (gguf_quant.PACKED_MAX_ROWS_AMX if gguf_quant.gemm_available(ops) else
            gguf_quant.PACKED_MAX_ROWS if ops.gguf_kernel() == "avx512_vnni" else
            gguf_quant.PACKED_MAX_ROWS_PORTABLE)
    assert gguf_quant.packed_max_rows(ops) == want


# ---- served end to end --------------------------------------------------------------------------
def _serve(path, monkeypatch, caplog, dtype="bfloat16", **kw):
    from conftest import make_prompts

    from engine import LLM, SamplingParams

    monkeypatch.delenv("PAGEDSERVE_GGUF_PACKED", raising=False)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), dtype=dtype, max_model_len=128, **kw)
    prompts = make_prompts(6, seed=3, max_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf:")]
    return llm, outs, lines


def _agree(outs, ref_outs) -> None:
    """test_gguf_quant.py's bound for packed against dequantized tokens."""
    got, want = [o.token_ids for o in outs], [o.token_ids for o in ref_outs]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 4
    assert sum(g == w for g, w in zip(got, want)) >= 2
    gaps = _logprob_gaps(outs, ref_outs)
    assert max(gaps) < 0.6 and np.mean(gaps) < 0.05


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_default_serves_a_gguf_packed_and_agrees_with_dense(qtype, tiny_gguf, cache,  # noqa: F811
                                                            monkeypatch, caplog):
    path = tiny_gguf(qtype)
    llm, outs, lines = _serve(path, monkeypatch, caplog)
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, GGUFWeights)
    assert any(line.startswith("gguf: weights ") and "(auto" in line for line in lines), lines
    assert llm.engine.runner.fused_decode is not None  # the fused decode step still runs
    dense_llm, ref, dense_lines = _serve(path, monkeypatch, caplog, gguf_weights="dense")
    dense_qkv = dense_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert getattr(dense_qkv, "quant", None) is None
    assert any("weights dense (dequantized), --gguf-weights dense" in x for x in dense_lines)
    _agree(outs, ref)


def test_auto_with_both_copies_serves_and_agrees_with_dense(tiny_gguf, cache,  # noqa: F811
                                                            monkeypatch, caplog):
    """A limit of 2 rows (as on AMX, where one is set): prefill on the dense copy, the decode
    of 6 sequences on it too through the fused dense step, a 2-sequence tail on the packed."""
    _set_limit(monkeypatch, 2)
    path = tiny_gguf("Q8_0")
    llm, outs, lines = _serve(path, monkeypatch, caplog, max_num_seqs=6)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.forward, GGUFDispatch) and qkv.forward.max_rows == 2
    fused = llm.engine.runner.fused_decode
    assert fused is not None and fused.dense_step is not None and fused.packed_max_rows == 2
    assert any("calls of up to 2 rows run on them" in line for line in lines), lines
    _, ref, _ = _serve(path, monkeypatch, caplog, gguf_weights="dense")
    _agree(outs, ref)


def test_packed_flag_and_float32(tiny_gguf, cache, monkeypatch, caplog):  # noqa: F811
    path = tiny_gguf("Q8_0")
    llm, _, lines = _serve(path, monkeypatch, caplog, gguf_weights="packed")
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant, GGUFWeights)
    assert model.model.layers[0].self_attn.qkv_proj.packed is None  # no dense copy
    assert any("weights packed (--gguf-weights packed)" in line for line in lines)
    del llm
    llm, _, lines = _serve(path, monkeypatch, caplog, dtype="float32")  # auto: exact path
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert getattr(qkv, "quant", None) is None
    assert any("float32 is the exact path" in line for line in lines)


def test_cli_flag():
    assert engine_config(parse_args(["serve"])).gguf_weights == "auto"
    for mode in ("auto", "packed", "dense"):
        assert engine_config(parse_args(["serve", "--gguf-weights", mode])).gguf_weights == mode
    with pytest.raises(SystemExit):
        parse_args(["serve", "--gguf-weights", "fast"])
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        EngineConfig(gguf_weights="fast")
    with pytest.raises(ValueError, match="drop it for gguf_weights 'dense'"):
        EngineConfig(quantization="gguf", gguf_weights="dense")
