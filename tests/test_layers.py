"""engine/layers: each layer's CPU kernel against its torch oracle, the choice made once at load,
the fused decode step declining models it does not cover, and model files free of kernels.

The kernels must build here (a None from load_cpu_ops() fails these tests) unless
PAGEDSERVE_CPU_KERNELS=0 turns them off, which skips the kernel comparisons.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from engine.layers import (
    CPU,
    NATIVE,
    PACKED,
    KernelLayer,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    select_impls,
)
from engine.layers.rotary import NativeRope
from engine.runner.fused_decode import FusedDecode
from pagedserve_kernels.backend import AttentionBackend, AttentionMetadata
from pagedserve_kernels.cpu_backend import CpuAttentionBackend
from pagedserve_kernels.cpu_linear import PackedLinear
from pagedserve_kernels.cpu_ops import cpu_kernels_enabled, load_cpu_ops
from pagedserve_kernels.reference import TorchAttentionBackend

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
MODELS_DIR = Path(__file__).resolve().parent.parent / "engine" / "models"


@pytest.fixture(scope="module")
def ops():
    if not cpu_kernels_enabled():
        pytest.skip("PAGEDSERVE_CPU_KERNELS=0: the CPU kernels are turned off")
    loaded = load_cpu_ops()
    assert loaded is not None, (
        "pagedserve_kernels/csrc did not build (see the warning load_cpu_ops logged)"
    )
    return loaded


def _spy(ops, calls: list[str]):
    """ops whose every call is recorded by name in `calls`."""

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            return lambda *args: (calls.append(name), fn(*args))[1]

    return Spy()


def _pair(make, ops):
    """(kernel layer, oracle layer), the same parameters, selected with ops and with None."""
    kernel, oracle = make(), make()
    oracle.load_state_dict(kernel.state_dict())
    kernel.select(ops)
    oracle.select(None)
    return kernel, oracle


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any(), "unwritten (NaN) output elements"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ULP[got.dtype], atol=1e-2)
    exact = (got == want).float().mean().item()
    assert exact >= 0.95, f"only {exact:.2%} of elements equal the oracle's"


# ---- each layer's kernel against its oracle -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_kernel_matches_oracle(ops, dtype):
    gen = torch.Generator().manual_seed(1)

    def make():
        norm = RMSNorm(96, 1e-5)
        norm.weight.data = (1 + 0.5 * torch.randn(96, generator=torch.Generator().manual_seed(2)))
        return norm.to(dtype)

    kernel, oracle = _pair(make, ops)
    assert (kernel.impl, oracle.impl) == (CPU, NATIVE)
    x = torch.randn(19, 96, generator=gen).to(dtype)
    residual = torch.randn(19, 96, generator=gen).to(dtype)
    _close(kernel(x.clone()), oracle(x))
    got_x, got_res = kernel(x.clone(), residual.clone())  # the kernel works in place
    want_x, want_res = oracle(x, residual)
    _close(got_x, want_x)
    _close(got_res, want_res)
    # per head (q/k norm): [T, H, D] views of a wider fused row
    rows = torch.randn(7, 5 * 96, generator=gen).to(dtype)
    heads = rows[:, : 3 * 96].view(7, 3, 96)
    _close(kernel(heads), oracle(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_kernel_matches_oracle(ops, dtype):
    gen = torch.Generator().manual_seed(3)
    kernel, oracle = _pair(lambda: RotaryEmbedding(64, 10000.0), ops)
    assert (kernel.impl, oracle.impl) == (CPU, NATIVE)
    positions = torch.tensor([0, 5, 17, 300, 1023, 2])
    qkv = torch.randn(6, (4 + 2 * 2) * 64, generator=gen).to(dtype)  # as the fused projection
    rows = qkv.clone()
    q, k = rows[:, : 4 * 64].view(6, 4, 64), rows[:, 4 * 64 : 6 * 64].view(6, 2, 64)
    gq, gk = kernel.prepare(positions, 1024, dtype).rotate(q, k)
    assert gq.data_ptr() == q.data_ptr(), "the kernel rotates the qkv row in place"
    # The kernel rotates in float32 with cos/sin rounded to dtype (as the oracle's) and rounds
    # once: the oracle's cos/sin applied in float32, rounded, is its value.
    rope = oracle.prepare(positions, 1024, dtype)
    q0, k0 = qkv[:, : 4 * 64].view(6, 4, 64).float(), qkv[:, 4 * 64 : 6 * 64].view(6, 2, 64).float()
    wq, wk = NativeRope(rope.cos.float(), rope.sin.float()).rotate(q0, k0)
    _close(gq, wq.to(dtype))
    _close(gk, wk.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_kernel_matches_oracle(ops, dtype):
    kernel, oracle = _pair(SiluAndMul, ops)
    assert (kernel.impl, oracle.impl) == (CPU, NATIVE)
    gate_up = torch.randn(13, 2 * 80, generator=torch.Generator().manual_seed(4)).to(dtype)
    _close(kernel(gate_up), oracle(gate_up))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_kernel_matches_oracle(ops, bias):
    gen = torch.Generator().manual_seed(5)

    def make():
        torch.manual_seed(6)
        return Linear(128, 96, bias=bias).bfloat16()

    kernel, oracle = _pair(make, ops)
    assert (kernel.impl, oracle.impl) == (CPU, PACKED)
    assert isinstance(kernel.packed, PackedLinear) and kernel.weight is None
    # dense_linear adds a bias in float32 before its rounding, so it takes biased linears too
    dense = bool(ops.dense_linear_kernel())
    assert (kernel.kernel_weight is not None) == dense and oracle.kernel_weight is None
    native = make()
    assert native.impl == NATIVE  # not selected: the oracle
    with torch.inference_mode():
        for rows in (1, 7, 32, 33, 200):
            x = torch.randn(rows, 128, generator=gen).bfloat16()
            want = native(x)
            _close(kernel(x), want)
            _close(oracle(x), want)


def test_linear_stays_native_in_float32(ops):
    linear = Linear(64, 32, bias=True)
    linear.select(ops)
    assert linear.impl == NATIVE and linear.packed is None and linear.weight is not None


# ---- the choice is made once, at load -----------------------------------------------------------
@pytest.fixture(scope="module")
def layer_model_dir(tmp_path_factory):
    from conftest import build_tiny_model_dir

    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama-layers"),
        seed=8,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


def _load(model_dir, ops, dtype, monkeypatch):
    from transformers import AutoConfig

    import engine.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "load_cpu_ops", lambda: ops)
    backend = TorchAttentionBackend() if ops is None else CpuAttentionBackend(ops)
    cfg = AutoConfig.from_pretrained(model_dir)
    return model_runner.load_model(model_dir, cfg, backend, dtype, torch.device("cpu")), backend


def _forward(model, num_tokens: int = 5) -> torch.Tensor:
    attn = model.model.layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype
    shape = (4, 16, attn.num_kv_heads, attn.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(2)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    with torch.inference_mode():
        ids = torch.arange(3, 3 + num_tokens)
        hidden = model(ids, torch.arange(num_tokens), meta, kv)
        return model.compute_logits(hidden)


def _kernel_layers(model) -> list[KernelLayer]:
    return [m for m in model.modules() if isinstance(m, KernelLayer)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_off_select_oracles_and_run_no_kernel(ops, layer_model_dir, monkeypatch, dtype):
    """Loaded with kernels off, every layer is its oracle (linears packed by oneDNN in bf16) and
    a forward touches no kernel; loaded with them on, every layer is the kernel and runs it."""
    calls: list[str] = []
    off, _ = _load(layer_model_dir, None, dtype, monkeypatch)
    on, _ = _load(layer_model_dir, _spy(ops, calls), dtype, monkeypatch)
    linear_off = PACKED if dtype == torch.bfloat16 else NATIVE
    for layer in _kernel_layers(off):
        assert layer.ops is None
        assert layer.impl == (linear_off if isinstance(layer, Linear) else NATIVE), layer
    for layer in _kernel_layers(on):
        want = NATIVE if isinstance(layer, Linear) and dtype == torch.float32 else CPU
        assert layer.impl == want, layer
    calls.clear()
    want = _forward(off)
    assert calls == [], "the kernels-off model called a kernel"
    got = _forward(on)
    kernels = {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"}
    if dtype == torch.bfloat16 and ops.dense_linear_kernel():
        kernels.add("dense_linear")
    assert kernels <= set(calls), f"kernels not run: {kernels - set(calls)}"
    tol = (5e-2 if dtype == torch.bfloat16 else 1e-4) * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_implementation_is_chosen_once_at_load(ops, layer_model_dir, monkeypatch):
    chosen: list[str] = []
    for cls in (KernelLayer, Linear):  # the classes that define select()
        real = cls.__dict__["select"]

        def counting(self, loaded, real=real):
            chosen.append(type(self).__name__)
            real(self, loaded)

        monkeypatch.setattr(cls, "select", counting)
    model, _ = _load(layer_model_dir, ops, torch.bfloat16, monkeypatch)
    n = len(_kernel_layers(model))
    assert len(chosen) == n > 0 and "RMSNorm" in chosen
    assert any(name.endswith("Linear") for name in chosen)  # the tensor-parallel ones too
    for _ in range(2):
        _forward(model)
    assert len(chosen) == n, "a forward chose an implementation again"


def test_select_impls_counts_each_layer_once(ops):
    model = torch.nn.Sequential(RMSNorm(32, 1e-6), SiluAndMul(), Linear(32, 16))
    assert select_impls(model, ops) == {CPU: 2, NATIVE: 1}  # float32 linear: not packed
    assert select_impls(model, None) == {NATIVE: 3}


# ---- the fused decode step: built from the layers, declines what it does not cover -------------
def test_fused_decode_builds_for_llama_in_bf16_only(ops, layer_model_dir, monkeypatch):
    if not ops.dense_linear_kernel():
        pytest.skip("the fused decode step needs dense_linear (AMX or AVX-512 BF16)")
    bf16, backend = _load(layer_model_dir, ops, torch.bfloat16, monkeypatch)
    assert FusedDecode.build(bf16, backend) is not None
    assert FusedDecode.build(bf16, TorchAttentionBackend()) is None  # no fused step declared
    f32, backend = _load(layer_model_dir, ops, torch.float32, monkeypatch)
    assert FusedDecode.build(f32, backend) is None  # float32: no packed linears


def test_fused_decode_declines_models_it_does_not_cover(
    ops, layer_model_dir, monkeypatch, tmp_path
):
    if not ops.dense_linear_kernel():
        pytest.skip("the fused decode step needs dense_linear (AMX or AVX-512 BF16)")
    from conftest import build_tiny_model_dir

    biased = build_tiny_model_dir(
        tmp_path / "bias", seed=9, hidden_size=128, intermediate_size=256, attention_bias=True
    )
    model, backend = _load(biased, ops, torch.bfloat16, monkeypatch)
    assert FusedDecode.build(model, backend) is None, "qkv/o with a bias"
    model, backend = _load(layer_model_dir, ops, torch.bfloat16, monkeypatch)
    attn = model.model.layers[1].self_attn
    attn.q_norm = RMSNorm(attn.head_dim, 1e-6)  # as Qwen3 has
    assert FusedDecode.build(model, backend) is None, "a q/k norm"
    del attn.q_norm
    assert FusedDecode.build(model, backend) is not None

    class OffsetNorm(RMSNorm):  # another norm (Gemma's 1 + weight)
        pass

    model.model.layers[0].input_layernorm.__class__ = OffsetNorm
    assert FusedDecode.build(model, backend) is None, "a norm subclass"


# ---- declared capabilities ----------------------------------------------------------------------
def test_backends_declare_capabilities():
    flags = ("supports_cuda_graphs", "supports_cascade", "supports_fused_decode")
    flags += ("supports_sliding_window", "supports_softcap")
    assert not any(getattr(AttentionBackend, f) for f in flags)
    torch_flags = [getattr(TorchAttentionBackend(), f) for f in flags]
    assert torch_flags == [False, False, False, True, True]  # the oracle masks windows, caps
    cpu = CpuAttentionBackend(None)
    assert cpu.supports_cascade and cpu.supports_fused_decode and not cpu.supports_cuda_graphs
    assert cpu.supports_sliding_window and cpu.supports_softcap
    assert TorchAttentionBackend().cascade_plan(9, torch.bfloat16, None, None, None, 99) is None
    assert TorchAttentionBackend().fused_decode(None) is None


# ---- model files compose layers and never reach for the CPU kernels -----------------------------
KERNEL_NAMES = re.compile(
    r"cpu_ops|cpu_backend|cpu_linear|load_cpu_ops|PackedLinear|amx|decode_layers|\bops\b"
)


def test_no_model_file_references_the_cpu_kernels():
    files = sorted(MODELS_DIR.rglob("*.py"))
    assert MODELS_DIR / "llama.py" in files
    for path in files:
        text = path.read_text()
        hits = [m.group(0) for m in KERNEL_NAMES.finditer(text)]
        assert not hits, f"{path.name} references the CPU kernels: {sorted(set(hits))}"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                assert node.module in ("__future__", "torch", "torch.nn", "pagedserve_kernels") or (
                    node.module.startswith(("engine.layers", "engine.models"))
                ), f"{path.name} imports {node.module}"
