"""Phi-3's fused targets: PEFT adapters on its `qkv_proj` and `gate_up_proj` (Hugging Face's
Phi-3 fuses them, as our model does) load, split B's rows across q/k/v and gate/up, and give
PEFT's greedy tokens in float32, alone and mixed with another adapter and the base model."""

from __future__ import annotations

import pytest
from conftest import make_prompts
from test_lora import ATTN, build_adapter, make_engine, peft_greedy, run
from test_model_families import build_family_dir

from engine.lora.request import LoRAError

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3-lora")
    model_dir = build_family_dir(root / "phi3", "phi3")
    adapters = {
        "all": build_adapter(model_dir, root / "all", 41, 8, FUSED, lora_alpha=16),
        "qkv": build_adapter(
            model_dir, root / "qkv", 42, 4, ["qkv_proj"], lora_alpha=8, use_rslora=True
        ),
        "mlp": build_adapter(model_dir, root / "mlp", 43, 16, ["gate_up_proj"], lora_alpha=8),
    }
    return model_dir, adapters


def test_fused_targets_alone_and_mixed_match_peft(phi3):
    model_dir, adapters = phi3
    prompts = make_prompts(2, seed=11, min_len=9, max_len=14)
    base = peft_greedy(model_dir, None, prompts, 8)
    expected = {name: peft_greedy(model_dir, path, prompts, 8) for name, path in adapters.items()}
    engine = make_engine(model_dir, adapters, max_loras=3)
    for name in adapters:
        assert expected[name] != base, f"{name}: the adapter should change the greedy tokens"
        got, _ = run(engine, [(p, name) for p in prompts])
        assert got == expected[name], name
    jobs = [(p, n) for p in prompts for n in [None, *adapters]]
    got, _ = run(engine, jobs)
    want = [base[i] if n is None else expected[n][i] for i in range(2) for n in [None, *adapters]]
    assert got == want
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks


def test_split_targets_on_phi3_and_fused_ones_on_llama_are_refused(phi3, tiny_model_dir, tmp_path):
    """Phi-3's Hugging Face modules are fused (no q_proj), Llama's are apart (no qkv_proj)."""
    model_dir, adapters = phi3
    llama_adapter = build_adapter(tiny_model_dir, tmp_path / "llama", 44, 4, ATTN)
    engine = make_engine(model_dir, {})
    with pytest.raises(LoRAError, match="the base model has no module [qkv]_proj") as e:
        engine.lora_registry.load("split", str(llama_adapter))
    assert "'qkv_proj'" in str(e.value) and "adapter_model.safetensors" in str(e.value)
    llama = make_engine(tiny_model_dir, {})
    with pytest.raises(LoRAError, match="the base model has no module qkv_proj"):
        llama.lora_registry.load("fused", str(adapters["qkv"]))


def test_fused_targets_in_the_fused_decode_step_bf16(phi3, ops):
    """bf16: a Phi-3 adapter's decode steps run the fused decode step with the adapters added
    (decode_layers_lora on the split B rows), the same tokens as the per-layer path."""
    model_dir, adapters = phi3
    engine = make_engine(model_dir, {"all": adapters["all"]}, dtype="bfloat16")
    runner = engine.runner
    fused = runner.fused_decode
    assert fused is not None
    calls, fused_run = [], fused.run

    def spy(*a, **k):
        calls.append(k.get("lora"))
        return fused_run(*a, **k)

    fused.run = spy
    prompts = make_prompts(2, seed=12, min_len=10, max_len=12)
    jobs = [(prompts[0], "all"), (prompts[1], None)]
    tuned, _ = run(engine, jobs)
    base, _ = run(engine, [(p, None) for p in prompts])
    assert tuned[0] != base[0] and tuned[1] == base[1]
    assert len(calls) == 2 * 7 and all(lora is not None for lora in calls[:7])
    runner.fused_decode = None  # the per-layer path: the same tokens
    assert run(engine, jobs)[0] == tuned
