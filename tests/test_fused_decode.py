"""The fused decode step over Qwen3's per-head q/k norms and Qwen2's q/k/v bias: taken, and
bit-identical to the layers."""

from __future__ import annotations

import pytest
import torch
from conftest import count_fused_calls

from pagedserve_kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.dense_linear_kernel(),
    reason="the fused decode step needs dense_linear (AMX or AVX-512 BF16)",
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import build_family_dir

    path = build_family_dir(tmp_path_factory.mktemp("qwen3-fused"), "qwen3")
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():  # norms load as ones: make every q and k norm differ
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = torch.rand(w.shape, generator=gen).to(w.dtype) + 0.5
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import build_family_dir

    path = build_family_dir(tmp_path_factory.mktemp("qwen2-fused"), "qwen2")
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    for name, w in weights.items():  # biases may load as zeros: make every q/k/v bias count
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            weights[name] = torch.randn(w.shape, generator=gen).to(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_qwen3_decodes_fused_with_the_logprobs_of_the_layer_by_layer_path(
    qwen3_dir, monkeypatch
):
    """Decode-only steps go through decode_layers with eight weights per layer; greedy tokens and
    their logprobs (the logits, to the bit) equal those of the layer-by-layer path."""
    assert_fused_equals_layers(qwen3_dir, 8, monkeypatch)


def test_qwen2_decodes_fused_with_the_logprobs_of_the_layer_by_layer_path(
    qwen2_dir, monkeypatch
):
    """Qwen2's q/k/v bias rides in the qkv linear's epilogue: seven weights per layer, and the
    tokens and logprobs of the layer-by-layer path (whose packed linear adds it the same way)."""
    assert_fused_equals_layers(qwen2_dir, 7, monkeypatch)


def assert_fused_equals_layers(model_dir, weights_per_layer: int, monkeypatch) -> None:
    import pagedserve_kernels.cpu_backend as cpu_backend
    from engine import LLM, SamplingParams
    from tests.conftest import make_prompts

    prompts = make_prompts(5, seed=3, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = {}
    for name, max_rows in (("fused", cpu_backend.FUSED_DECODE_MAX_ROWS), ("layers", 0)):
        monkeypatch.setattr(cpu_backend, "FUSED_DECODE_MAX_ROWS", max_rows)
        llm = LLM(str(model_dir), dtype="bfloat16")
        fused = llm.engine.runner.fused_decode
        num_layers = len(llm.engine.runner.model.model.layers)
        assert fused is not None
        assert len(fused.step.stack.layer_weights) == weights_per_layer * num_layers
        calls = count_fused_calls(fused)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
        outs[name + "_calls"] = len(calls)
    assert outs["fused_calls"] > 0 and outs["layers_calls"] == 0
    assert outs["fused"] == outs["layers"]

