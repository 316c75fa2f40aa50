"""The fused decode step over GGUF-packed linears (pagedserve_kernels/csrc/decode_layers.cpp
decode_layers_mixed): taken for a packed model, and bit-identical to the layer-by-layer packed
path, which calls the same kernels (gguf_linear part by part, amx_linear for a bf16 linear)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import count_fused_calls, kernel_path_fixture

from engine.gguf.convert import BLOCKS_FILE
from engine.layers.quantization.gguf import GGUF_PACKED_ENV, GGUFWeights
from pagedserve_kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.dense_linear_kernel(),
    reason="the fused decode step needs dense_linear (AMX or AVX-512 BF16)",
)

# Per layer, the GGUF type of each HF tensor; a name left out stays bf16 (AMX-packed). Layer 0
# splits q/k/v into three parts and gate/up into two (as Q4_K_M files do), layer 1 fuses
# q/k/v into one part and keeps down_proj in bf16: every type, mixed with an AMX linear.
LAYER_TYPES = [
    {"q_proj": "Q8_0", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_1",
     "gate_proj": "Q4_0", "up_proj": "Q4_K", "down_proj": "Q5_K"},
    {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q5_0",
     "gate_proj": "Q6_K", "up_proj": "Q6_K"},
]
PARTS = [(["Q8_0", "Q4_K", "Q6_K"], ["Q4_0", "Q4_K"]), (["Q4_1"], ["Q6_K"])]


def _packed_dir(path, family: str):
    """A tiny random model (hidden 256: the K types fit) with its linears' GGUF blocks beside
    it, typed per LAYER_TYPES (random valid blocks), and the lm_head's (tied: the embedding's)
    in Q8_0."""
    import transformers
    from safetensors.numpy import save_file

    from tests.conftest import build_byte_tokenizer
    from tests.test_gguf_quant import random_blocks

    tokenizer = build_byte_tokenizer()
    qwen2 = family == "qwen2"
    cfg = dict(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=qwen2, initializer_range=0.05,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_cls = transformers.Qwen2Config if qwen2 else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(config_cls(**cfg)).float().eval()
    if qwen2:  # biases load as zeros: make every q/k/v bias count
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.data.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    blocks, types = {}, {}
    for i, layer_types in enumerate(LAYER_TYPES):
        for leaf, qtype in layer_types.items():
            group = "self_attn" if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{i}.{group}.{leaf}.weight"
            n, k = model.get_parameter(name).shape
            blocks[name], types[name] = random_blocks(qtype, n, k, seed=len(blocks)), qtype
    head = "model.embed_tokens.weight" if qwen2 else "lm_head.weight"
    blocks[head] = random_blocks("Q8_0", len(tokenizer), 256, seed=99)
    types[head] = "Q8_0"
    save_file({n: np.ascontiguousarray(b) for n, b in blocks.items()}, str(path / BLOCKS_FILE),
              metadata=types)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def packed_dir(request, tmp_path_factory):
    return _packed_dir(tmp_path_factory.mktemp(f"gguf-decode-{request.param}"), request.param)


def _serve(model_dir, monkeypatch, max_rows: int):
    import pagedserve_kernels.cpu_backend as cpu_backend
    from engine import LLM

    monkeypatch.setenv(GGUF_PACKED_ENV, "1")
    monkeypatch.setattr(cpu_backend, "FUSED_DECODE_MAX_ROWS", max_rows)
    return LLM(str(model_dir), dtype="bfloat16", max_model_len=256)


@pytest.mark.parametrize("num_prompts", [1, 5, 20])
def test_packed_model_decodes_fused_with_the_bits_of_the_layer_by_layer_path(
    packed_dir, monkeypatch, num_prompts
):
    """c=1 and batches: every decode step of the GGUF-packed model runs in one
    decode_layers_mixed call, and its greedy tokens and logprobs (the logits, to the bit) equal
    the layer-by-layer packed path's. 20 rows reach gguf_gemm's threshold (GEMM_MIN_ROWS), so
    the step must switch kernels at the same row count as the layers."""
    import pagedserve_kernels.cpu_backend as cpu_backend
    from engine import SamplingParams
    from tests.conftest import make_prompts

    prompts = make_prompts(num_prompts, seed=7, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs, calls = {}, {}
    for name, max_rows in (("fused", cpu_backend.FUSED_DECODE_MAX_ROWS), ("layers", 0)):
        llm = _serve(packed_dir, monkeypatch, max_rows)
        layers = llm.engine.runner.model.model.layers
        for layer, (qkv_parts, gate_up_parts) in zip(layers, PARTS):
            assert layer.self_attn.qkv_proj.quant.qtypes() == qkv_parts
            assert layer.mlp.gate_up_proj.quant.qtypes() == gate_up_parts
        assert isinstance(layers[0].mlp.down_proj.quant, GGUFWeights)
        assert layers[1].mlp.down_proj.kernel_weight is not None  # bf16, AMX-packed
        fused = llm.engine.runner.fused_decode
        assert fused is not None and fused.step.mixed is not None
        calls[name] = count_fused_calls(fused)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
    # 7 decode steps per prompt at c=1; a batch shares its steps
    assert len(calls["fused"]) >= 7 and not calls["layers"]
    assert outs["fused"] == outs["layers"]


def test_packed_model_without_the_kernels_declines_the_fused_step(packed_dir, monkeypatch):
    """GGUF weights on the torch path (no C++ kernels bound to them) leave the step to the
    layers rather than handing the kernel weights it cannot read."""
    from engine.runner.fused_decode import decoder_stack

    llm = _serve(packed_dir, monkeypatch, 32)
    model = llm.engine.runner.model
    assert decoder_stack(model) is not None
    monkeypatch.setattr(model.model.layers[1].self_attn.o_proj.quant, "ops", None)
    assert decoder_stack(model) is None


def test_mixed_layout_spec_is_checked():
    """A spec that does not match the weights stops the kernel before it reads any."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    norm = torch.ones(64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    i32 = torch.zeros(1, dtype=torch.int32)
    args = (
        [cache, cache], norm, torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, 1, dtype=torch.int32), i32, 0, i32, i32, i32, 1, 1, 64, 1e-5, 0.125, False,
    )
    spec = torch.tensor([1, 64, 8, 128, 0, 0], dtype=torch.int64)  # one Q8_0 part, no tensors
    with pytest.raises(RuntimeError, match="weights end"):
        ops.decode_layers_mixed(x, i32.long(), x, [norm], spec, False, False, *args)


kernel_path = kernel_path_fixture("gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_activations_round_half_to_even_per_32_block(kernel_path, dtype, m):
    """Each decode linear quantizes x as the torch oracle does: per 32-block d = max|x| / 127
    and q = round-half-even(x / d) (a true division). With Q8_0 weights of scale 1, an output is
    sum over blocks of d * (dot(u, q) - 128 * sum(q)) in float32, so any other rounding of one
    quant changes its bits; half of x sits exactly on .5 steps, and one block is all zeros."""
    from engine.layers.quantization.gguf import PackedQuant, unpack_blocks

    n, k = 20, 96  # a ragged channel group, three blocks
    gen = torch.Generator().manual_seed(m)
    raw = np.zeros((n, k // 32, 34), np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    quants = torch.randint(-127, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
    raw[..., 2:] = quants.numpy().view(np.uint8)
    p = PackedQuant("Q8_0", *unpack_blocks("Q8_0", raw.reshape(n, -1)))
    steps = 2.0 ** torch.randint(-6, 3, (m, k // 32, 1), generator=gen)  # d of each block
    ties = torch.randint(-126, 126, (m, k // 32, 32), generator=gen) + 0.5
    x = torch.where(torch.rand(m, k // 32, 32, generator=gen) < 0.5, ties,
                    (torch.randn(m, k // 32, 32, generator=gen) * 60).clamp(-126, 126)) * steps
    x[:, :, 0] = 127 * steps[..., 0]  # the block's max: d is the step exactly
    x[0, 1] = 0.0
    x = x.reshape(m, k).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    ops.gguf_linear(out, x, p.qs, p.qh, p.scales, p.mins, p.bits, p.zero, None)
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127  # float32, as the kernel
    q = torch.where(d[..., None] == 0, 0.0, torch.round(xb / d[..., None])).clamp(-127, 127)
    u = p.quants().long().view(n, k // 32, 32)
    want = torch.zeros(m, n)
    for b in range(k // 32):
        dot = (q[:, b].long() @ u[:, b].T).float()  # exact integers
        xc = d[:, b, None] * (q[:, b].sum(-1, keepdim=True) * -128.0)
        want = want + (dot * d[:, b, None] + xc)
    assert torch.equal(out, want.to(dtype))
