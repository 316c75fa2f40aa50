"""LoRA adapters on packed GGUF linears (--quantization gguf, the blocks kept packed, bf16): the
adapters are taken, not dropped. Each linear's output moves by exactly s (x A^T) B^T on an
adapter's tokens and not at all on the base model's; in a step mixing both the base request's
tokens are the base-only run's."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import build_byte_tokenizer, make_prompts
from gguf_writer import write_gguf
from test_lora import ATTN, MLP, build_adapter, make_engine, run

PARTS = {
    "qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
    "o_proj": ("self_attn", ["o_proj"]),
    "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]),
    "down_proj": ("mlp", ["down_proj"]),
}


@pytest.fixture(scope="module")
def q8_llama(tmp_path_factory):
    """A tiny random Llama (hidden 256, so GGUF blocks fit) as its HF folder and a Q8_0 GGUF."""
    import transformers

    root = tmp_path_factory.mktemp("lora-gguf")
    tokenizer = build_byte_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.05,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    src = root / "hf"
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(src)
    tokenizer.save_pretrained(src)
    path = root / "tiny-Q8_0.gguf"
    write_gguf(src, path, "llama", "Tiny Llama", gguf.GGMLQuantizationType.Q8_0)
    return src, path


def test_packed_gguf_linears_take_adapters(q8_llama, tmp_path, monkeypatch):
    from engine.layers.quantization.gguf import GGUFWeights

    src, path = q8_llama
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDSERVE_GGUF_PACKED", raising=False)
    adapter = build_adapter(src, tmp_path / "a", 61, 8, ATTN + MLP, std=0.1, lora_alpha=16)
    engine = make_engine(
        path, {"a": adapter}, dtype="bfloat16", quantization="gguf", max_model_len=128
    )
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant, GGUFWeights)
    assert layer.self_attn.qkv_proj.weight is None  # packed blocks only
    prompts = make_prompts(2, seed=4, min_len=10, max_len=12)
    tuned, _ = run(engine, [(prompts[0], "a"), (prompts[1], None)])
    base, _ = run(engine, [(p, None) for p in prompts])
    assert tuned[0] != base[0] and tuned[1] == base[1]

    manager = engine.runner.lora
    (key,) = [k for k in manager.slots if k is not None]
    slot, adapter_w = manager.slots.index(key), manager.loaded[key]
    slots = torch.tensor([slot, -1, slot, -1, slot])
    gen = torch.Generator().manual_seed(5)
    for name, (owner, hf_parts) in PARTS.items():
        lin = getattr(getattr(layer, owner), name)
        x = torch.randn(len(slots), lin.in_features, generator=gen).to(torch.bfloat16)
        manager.batch.set(None, None)
        y0 = lin(x).float()
        manager.batch.set(slots, manager.slot_scaling)
        y1 = lin(x).float()
        manager.batch.set(None, None)
        pairs = [adapter_w.weights[(0, hf)] for hf in hf_parts]
        want = torch.cat([x.float() @ a.T @ b.T for a, b in pairs], dim=1) * adapter_w.scaling
        want[slots < 0] = 0
        tol = 2e-2 * want.abs().max().item() + 2**-7 * y0.abs().max().item()
        torch.testing.assert_close(y1 - y0, want, rtol=0, atol=tol, msg=name)
        assert want.abs().max() > 20 * tol, name  # the adapter's part is not lost in rounding
