"""Multi-LoRA: random-weight PEFT adapters give PEFT's greedy tokens, alone and mixed in one
batch with the base model, with prefix hits; bad adapters are refused naming file and tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_generate, make_prompts

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRAError, parse_lora_module
from engine.sampling_params import SamplingParams

BS = 4
MAX_NEW = 8
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base_dir: Path, out: Path, seed: int, r: int, targets, std: float = 0.3, **cfg
) -> Path:
    """A PEFT adapter with random A and B (PEFT's init leaves B zero: no effect), saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, target_modules=list(targets), init_lora_weights=False, **cfg)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter: Path | None, prompts, max_new: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_generate(model, p, max_new) for p in prompts]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "attn": build_adapter(tiny_model_dir, root / "attn", 1, 8, ATTN, lora_alpha=16),
        "mlp": build_adapter(tiny_model_dir, root / "mlp", 2, 4, MLP, lora_alpha=8),
        "all-rs": build_adapter(
            tiny_model_dir, root / "all-rs", 3, 16, ATTN + MLP, lora_alpha=8, use_rslora=True
        ),
        "qv": build_adapter(tiny_model_dir, root / "qv", 4, 2, ["q_proj", "v_proj"], lora_alpha=4),
    }


def make_engine(model_dir, adapters: dict[str, Path], **kw) -> LLMEngine:
    mods = tuple(f"{name}={path}" for name, path in adapters.items())
    cfg = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=BS)
    cfg |= dict(enable_lora=True, lora_modules=mods, max_loras=2, max_lora_rank=16) | kw
    return LLMEngine(EngineConfig(**cfg))


def run(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> tuple[list, list]:
    """Adds every (prompt, adapter) at once and steps to the end: (tokens, cached tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = {i: [] for i in range(len(jobs))}
    cached = {}
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, lora_name=lora)
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            tokens[int(out.request_id)] += out.outputs[0].token_ids
            cached[int(out.request_id)] = out.num_cached_tokens
    return [tokens[i] for i in range(len(jobs))], [cached[i] for i in range(len(jobs))]


def test_each_adapter_alone_matches_peft(tiny_model_dir, adapters):
    prompts = make_prompts(2, seed=5, min_len=9, max_len=14)
    engine = make_engine(tiny_model_dir, adapters)
    base = peft_greedy(tiny_model_dir, None, prompts, MAX_NEW)
    for name, path in adapters.items():
        expected = peft_greedy(tiny_model_dir, path, prompts, MAX_NEW)
        assert expected != base, f"{name}: the adapter should change the greedy tokens"
        got, _ = run(engine, [(p, name) for p in prompts])
        assert got == expected, name


def test_mixed_batch_of_three_adapters_and_base_with_prefix_hits(tiny_model_dir, adapters):
    prompt = make_prompts(1, seed=7, min_len=13, max_len=13)[0]  # 3 full blocks + 1
    names = [None, "attn", "mlp", "all-rs"]
    expected = [
        peft_greedy(tiny_model_dir, adapters[n] if n else None, [prompt], MAX_NEW)[0] for n in names
    ]
    engine = make_engine(tiny_model_dir, adapters)  # 2 slots for 3 adapters: the stacks widen
    got, cached = run(engine, [(prompt, n) for n in names])
    assert got == expected
    assert cached == [0, 0, 0, 0]  # one prompt, four identities: nothing shared in one step
    again, cached = run(engine, [(prompt, n) for n in reversed(names)])
    assert again == expected[::-1]
    assert cached == [12, 12, 12, 12]  # each hits only its own adapter's blocks
    kv = engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks


def test_reload_under_the_same_name_changes_output_and_misses_the_cache(
    tiny_model_dir, adapters, tmp_path
):
    prompt = make_prompts(1, seed=8, min_len=12, max_len=12)[0]
    swap = tmp_path / "swap"
    shutil.copytree(adapters["attn"], swap)
    engine = make_engine(tiny_model_dir, {"x": swap})
    (first,), _ = run(engine, [(prompt, "x")])
    shutil.rmtree(swap)
    shutil.copytree(adapters["qv"], swap)
    engine.lora_registry.load("x", str(swap))
    (second,), (hit,) = run(engine, [(prompt, "x")])
    assert hit == 0  # the old weights' KV is never reused
    assert first == peft_greedy(tiny_model_dir, adapters["attn"], [prompt], MAX_NEW)[0]
    assert second == peft_greedy(tiny_model_dir, adapters["qv"], [prompt], MAX_NEW)[0]


def test_loads_mid_request_never_disturb_running_requests(tiny_model_dir, adapters, tmp_path):
    """While a request runs under "x": a refused load (rank above --max-lora-rank), a new
    adapter and a reload of "x" with new weights; the running request still gets the old
    weights' PEFT tokens, and a request after the reload gets the new weights'."""
    prompt = make_prompts(1, seed=14, min_len=10, max_len=10)[0]
    engine = make_engine(tiny_model_dir, {"x": adapters["attn"]}, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("0", prompt, params, lora_name="x")
    tokens = [t for out in engine.step()[0] for t in out.outputs[0].token_ids]  # prefill
    with pytest.raises(LoRAError, match="r=16 exceeds --max-lora-rank 8"):
        engine.lora_registry.load("x", str(adapters["all-rs"]))
    tokens += [t for out in engine.step()[0] for t in out.outputs[0].token_ids]
    engine.lora_registry.load("other", str(adapters["mlp"]), load_inplace=False)
    engine.lora_registry.load("x", str(adapters["qv"]))  # new weights under the same name
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step()[0] for t in out.outputs[0].token_ids]
    assert tokens == peft_greedy(tiny_model_dir, adapters["attn"], [prompt], MAX_NEW)[0]
    (after,), _ = run(engine, [(prompt, "x")])
    assert after == peft_greedy(tiny_model_dir, adapters["qv"], [prompt], MAX_NEW)[0]


def test_unloaded_adapter_whose_folder_is_gone_and_slot_reused_finishes_its_requests(
    tiny_model_dir, adapters, tmp_path
):
    """Unload an adapter mid-request, delete its folder, let another adapter take its only
    slot: the running request still finishes on its own weights (never re-read from disk)."""
    from types import SimpleNamespace

    prompt = make_prompts(1, seed=9, min_len=10, max_len=10)[0]
    gone = shutil.copytree(adapters["attn"], tmp_path / "gone")
    engine = make_engine(
        tiny_model_dir, {"gone": gone, "mlp": adapters["mlp"]}, max_loras=1, max_cpu_loras=1
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("0", prompt, params, lora_name="gone")
    tokens = [t for out in engine.step()[0] for t in out.outputs[0].token_ids]  # prefill
    engine.lora_registry.unload("gone")
    shutil.rmtree(gone)
    other = engine.lora_registry.get("mlp")
    lora = engine.runner.lora
    lora.prepare([SimpleNamespace(lora_request=other)], [1])  # a step of "mlp" takes the slot
    assert lora.slots == [other.content_hash]
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step()[0] for t in out.outputs[0].token_ids]
    assert tokens == peft_greedy(tiny_model_dir, adapters["attn"], [prompt], MAX_NEW)[0]
    with pytest.raises(ValueError, match="`gone` does not exist"):
        engine.add_request("1", prompt, params, lora_name="gone")
    (tuned,), _ = run(engine, [(prompt, "mlp")])  # the slot serves the other adapter again
    assert tuned == peft_greedy(tiny_model_dir, adapters["mlp"], [prompt], MAX_NEW)[0]
    import gc

    gc.collect()
    assert not lora.retired  # the last request under it finished: its weights are dropped


def test_evicted_adapter_whose_folder_is_gone_is_refused_at_admission(
    tiny_model_dir, adapters, tmp_path
):
    """--max-cpu-loras 1: an adapter evicted from memory whose folder is then deleted (or whose
    files change) is refused when a request asks for it, naming the adapter and the file; the
    requests admitted before keep their weights in memory, evicted or not, and finish on them."""
    import gc

    prompt = make_prompts(1, seed=10, min_len=10, max_len=10)[0]
    gone = shutil.copytree(adapters["attn"], tmp_path / "gone")
    changed = shutil.copytree(adapters["qv"], tmp_path / "changed")
    mods = {"gone": gone, "changed": changed, "mlp": adapters["mlp"]}
    engine = make_engine(tiny_model_dir, mods, max_loras=1, max_cpu_loras=1)
    lora = engine.runner.lora
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("0", prompt, params, lora_name="gone")  # read back from the folder
    engine.add_request("1", prompt, params, lora_name="mlp")  # evicts "gone" again
    assert list(lora.loaded) == [engine.lora_registry.get("mlp").content_hash]
    shutil.rmtree(gone)  # "0" is queued: its adapter is evicted and its folder gone
    tokens = {"0": [], "1": []}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            tokens[out.request_id] += out.outputs[0].token_ids
    assert tokens["0"] == peft_greedy(tiny_model_dir, adapters["attn"], [prompt], MAX_NEW)[0]
    assert tokens["1"] == peft_greedy(tiny_model_dir, adapters["mlp"], [prompt], MAX_NEW)[0]
    gc.collect()
    with lora._lock:
        lora._drain_released()
    assert not lora.pinned  # both requests are gone: their pins too
    with pytest.raises(ValueError, match="LoRA adapter `gone` cannot be served") as e:
        engine.add_request("2", prompt, params, lora_name="gone")
    assert e.value.param == "model"
    assert f"{gone}: no such LoRA adapter folder" in str(e.value)
    assert "evicted from memory (--max-cpu-loras 1)" in str(e.value)
    assert "/v1/load_lora_adapter" in str(e.value)  # the fix
    shutil.copy(adapters["attn"] / "adapter_model.safetensors", changed)  # other weights
    with pytest.raises(ValueError, match=f"{changed}: its files changed"):
        engine.add_request("3", prompt, params, lora_name="changed")
    assert "2" not in engine.scheduler.requests and "3" not in engine.scheduler.requests
    (tuned, base), _ = run(engine, [(prompt, "mlp"), (prompt, None)])  # still serving
    assert tuned == tokens["1"]
    assert base == peft_greedy(tiny_model_dir, None, [prompt], MAX_NEW)[0]
    kv = engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks


def test_unknown_adapter_is_refused(tiny_model_dir, adapters):
    engine = make_engine(tiny_model_dir, {"attn": adapters["attn"]})
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="nope"):
        engine.make_request("r", [5, 6], params, lora_name="nope")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_bad_adapters_are_refused_naming_file_and_tensor(
    tiny_model_dir, adapters, tmp_path_factory
):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")
    engine = make_engine(tiny_model_dir, {})
    load = engine.lora_registry.load

    missing = _copy(adapters["attn"], root / "missing")
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match=r"missing/adapter_model\.safetensors: missing"):
        load("m", str(missing))

    with pytest.raises(LoRAError, match="no such LoRA adapter folder"):
        load("m", str(root / "nowhere"))

    big = build_adapter(tiny_model_dir, root / "big", 9, 32, ["q_proj"])
    with pytest.raises(LoRAError, match=r"adapter_config\.json: r=32 exceeds --max-lora-rank 16"):
        load("m", str(big))

    shaped = _copy(adapters["attn"], root / "shaped")
    tensors = load_file(shaped / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.1.self_attn.k_proj.lora_B" in k)
    tensors[key] = torch.zeros(40, 8)
    save_file(tensors, shaped / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=rf"shaped/adapter_model\.safetensors: tensor {key} has sh"):
        load("m", str(shaped))

    embed = build_adapter(tiny_model_dir, root / "embed", 9, 4, ["q_proj", "embed_tokens"])
    with pytest.raises(LoRAError, match=r"target_modules \['embed_tokens'\] are not supported"):
        load("m", str(embed))
    _edit_config(embed, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match=r"tensor .*embed_tokens.*unsupported target"):
        load("m", str(embed))

    dora = _copy(adapters["attn"], root / "dora")
    _edit_config(dora, use_dora=True)
    with pytest.raises(LoRAError, match=r"dora/adapter_config\.json: use_dora=True"):
        load("m", str(dora))
    assert engine.lora_registry.adapters == {}  # nothing half-registered


def test_lora_module_forms():
    assert parse_lora_module("a=/x/y").path == "/x/y"
    spec = parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "base"}')
    assert (spec.name, spec.path, spec.base_model_name) == ("a", "/p", "base")
    with pytest.raises(LoRAError, match="expected name=path"):
        parse_lora_module("nopath")
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(model="x", lora_modules=("a=/b",))
    assert EngineConfig(model="x", enable_lora=True, tensor_parallel_size=2).enable_lora  # TP
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(model="x", enable_lora=True, max_loras=2, max_cpu_loras=1)


def _stacked(dtype, ops=None):
    from engine.layers.lora import LoRABatch, LoRALinearWeights

    torch.manual_seed(0)
    batch = LoRABatch(num_slots=3, max_rank=8, dtype=dtype, device="cpu", ops=ops)
    weights = LoRALinearWeights(40, [36, 6, 18], batch, dtype, "cpu")
    for slot, rank in enumerate((8, 3, 5)):
        parts = [(torch.randn(rank, 40), torch.randn(n, rank)) for n in (36, 6, 18)]
        parts[1 + slot % 2] = None  # a part the adapter does not target
        weights.set_slot(slot, parts)
    weights.grow(1)  # a fourth, empty slot
    batch.num_slots = 4
    return batch, weights


def _check_paths(batch, weights, slots, x, scaling, **tol):
    """The batched path (kernel or torch) adds the oracle's delta to the base output."""
    from engine.layers.lora import lora_delta_native

    batch.set(slots, scaling)
    y = torch.randn(len(slots), weights.out_features, dtype=x.dtype)
    ref = y.float() + lora_delta_native(weights, x).float()
    got = weights.add_to(y.clone(), x)
    torch.testing.assert_close(got.float(), ref, **tol)
    return got - y


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_stacked_gemms_equal_the_per_token_gather_oracle(path, request):
    ops = request.getfixturevalue("ops") if path == "kernel" else None
    batch, weights = _stacked(torch.float32, ops)
    scaling = torch.tensor([2.0, 0.5, 1.5, 1.0])
    slots = torch.tensor([-1, 0, 2, 1, 1, -1, 3, 0, 2])
    x = torch.randn(len(slots), 40)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    delta = _check_paths(batch, weights, slots, x, scaling, **tol)
    assert delta[0].abs().max() == 0 and delta[6].abs().max() == 0  # base tokens, an empty slot
    assert delta[1].abs().max() > 0
    low = torch.tensor([1, -1, 0, 1])  # slots 2 and 3 idle: the GEMMs take slots 0..1 only
    _check_paths(batch, weights, low, x[:4], scaling, **tol)
    one = torch.tensor([-1, 0, 0, -1, 0])  # one adapter and base tokens: only its rows
    delta = _check_paths(batch, weights, one, x[:5], scaling, **tol)
    assert delta[0].abs().max() == 0 and delta[1].abs().max() > 0
    assert (batch.rows is not None) == (path == "torch")
    _check_paths(batch, weights, torch.tensor([2, 2]), x[:2], scaling, **tol)  # all one slot


def test_lora_kernel_in_bf16_and_on_strided_rows(ops):
    """bf16 weights and activations, x a column slice of a wider buffer (as attention's output
    rows can be): the kernel (float32 inside, one rounding) stays within bf16 of the oracle."""
    batch, weights = _stacked(torch.bfloat16, ops)
    slots = torch.tensor([0, -1, 1, 2, 3, 0, 2, 1] * 5)
    x = torch.randn(len(slots), 64, dtype=torch.bfloat16)[:, 8:48]
    _check_paths(batch, weights, slots, x, torch.tensor([2.0, 0.5, 1.5, 1.0]), rtol=2e-2, atol=0.3)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_packed_linears_take_adapters_and_the_fused_step_too(
    tiny_model_dir, adapters, ops, quantization
):
    """bf16 packed (or int8) linears: an adapter's decode steps run the fused decode step with
    the adapters added (decode_layers_lora), the same tokens as the per-layer path; int8 (no
    fused step) runs layer by layer."""
    engine = make_engine(
        tiny_model_dir, {"attn": adapters["all-rs"]}, dtype="bfloat16", quantization=quantization
    )
    runner = engine.runner
    calls = []
    fused = runner.fused_decode
    if quantization is None:  # int8 has no fused decode step
        fused_run = fused.run

        def spy(*a, **k):
            calls.append(k.get("lora"))
            return fused_run(*a, **k)

        runner.fused_decode.run = spy
    prompts = make_prompts(2, seed=3, min_len=10, max_len=12)
    base, _ = run(engine, [(p, None) for p in prompts])
    assert calls == ([None] * (MAX_NEW - 1) if quantization is None else [])  # decode steps
    calls.clear()
    jobs = [(prompts[0], "attn"), (prompts[1], None)]  # an adapter and the base in one batch
    tuned, _ = run(engine, jobs)
    assert tuned[0] != base[0] and tuned[1] == base[1]
    if quantization is None:
        assert len(calls) == MAX_NEW - 1 and all(lora is not None for lora in calls)
        runner.fused_decode = None  # the per-layer path: the same tokens
        assert run(engine, jobs)[0] == tuned
        runner.fused_decode = fused


def test_max_loras_bounds_each_step_and_preemption_keeps_peft_tokens(tiny_model_dir, adapters):
    """--max-loras 1: each step runs at most one adapter (others wait their turn, FCFS); a KV
    pool too small for all of them preempts, and every request still gets PEFT's tokens."""
    prompts = make_prompts(4, seed=9, min_len=10, max_len=14)
    names = ["attn", None, "mlp", "attn"]
    expected = [
        peft_greedy(tiny_model_dir, adapters[n] if n else None, [p], MAX_NEW)[0]
        for p, n in zip(prompts, names)
    ]
    engine = make_engine(tiny_model_dir, adapters, max_loras=1, max_cpu_loras=2)
    manager = engine.runner.lora
    seen = []
    prepare = manager.prepare

    def spy(requests, counts):
        seen.append({r.lora_request.name for r in requests if r.lora_request})
        return prepare(requests, counts)

    manager.prepare = spy
    got, _ = run(engine, list(zip(prompts, names)))
    assert got == expected
    assert max(len(s) for s in seen) == 1 and {"attn", "mlp"} <= set().union(*seen)
    assert len(manager.slots) == 1  # never widened
    small = make_engine(tiny_model_dir, adapters, num_gpu_blocks_override=7)
    got, _ = run(small, list(zip(prompts, names)))
    assert got == expected
    assert small.scheduler.num_preemptions_total > 0


def test_max_loras_a_waiting_adapter_is_not_overtaken_by_the_running_one(tiny_model_dir, adapters):
    """--max-loras 1 with "attn" running and a stream of new "attn" requests arriving each step:
    the "mlp" request that arrived first is not overtaken by later "attn" ones (which could join
    the running adapter), so it runs as soon as the running adapter's requests finish."""
    engine = make_engine(tiny_model_dir, adapters, max_loras=1)
    prompts = make_prompts(8, seed=13, min_len=6, max_len=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("a0", prompts[0], params, lora_name="attn")
    engine.step()
    engine.add_request("m", prompts[1], params, lora_name="mlp")
    first: dict[str, int] = {}
    infos = []  # vllm:lora_requests_info's labels each step: (max_lora, running, waiting)
    for step in range(200):
        if step < 6:  # the running adapter's stream goes on while "m" waits
            engine.add_request(f"a{step + 1}", prompts[step + 2], params, lora_name="attn")
        outs, stats = engine.step()
        infos.append(stats.lora_info)
        for out in outs:
            first.setdefault(out.request_id, step)
        if not engine.has_unfinished_requests():
            break
    assert set(first) == {"m", *(f"a{i}" for i in range(7))}  # every request ran
    assert all(first["m"] < first[f"a{i}"] for i in range(1, 7)), first
    assert first["m"] <= MAX_NEW  # right after a0's last token
    assert infos[0] == (1, "attn", "attn,mlp")  # the labels llm-d's LoRA affinity reads
    assert infos[first["m"]] == (1, "mlp", "attn")


@pytest.mark.parametrize(
    "family,targets",
    [("qwen2", ATTN + MLP), ("qwen3", ATTN + MLP), ("mistral", ATTN), ("qwen3-moe", ATTN)],
)
def test_families_match_peft(family, targets, tmp_path):
    """q/k/v biases (Qwen2), q/k norms and head_dim * heads != hidden (Qwen3), MoE layers."""
    from test_model_families import build_family_dir

    model_dir = build_family_dir(tmp_path / family, family)
    adapter = build_adapter(model_dir, tmp_path / "adapter", 5, 8, targets, lora_alpha=16)
    prompts = make_prompts(2, seed=6, min_len=9, max_len=14)
    expected = peft_greedy(model_dir, adapter, prompts, MAX_NEW)
    assert expected != peft_greedy(model_dir, None, prompts, MAX_NEW)
    engine = make_engine(model_dir, {"a": adapter})
    got, _ = run(engine, [(p, "a") for p in prompts] + [(prompts[0], None)])
    assert got[:2] == expected


def test_moe_layers_refuse_mlp_adapters(tmp_path):
    from safetensors.torch import save_file
    from test_model_families import build_family_dir

    model_dir = build_family_dir(tmp_path / "moe", "qwen3-moe")
    adapter = build_adapter(model_dir, tmp_path / "adapter", 5, 4, ["q_proj"], lora_alpha=8)
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    save_file({key: torch.zeros(4, 64)}, adapter / "adapter_model.safetensors")
    engine = make_engine(model_dir, {})
    with pytest.raises(LoRAError, match=rf"tensor {key}: layer 0 of the base model has no dense"):
        engine.lora_registry.load("m", str(adapter))


def test_offline_llm_takes_vllm_style_lora_requests(tiny_model_dir, adapters):
    from types import SimpleNamespace

    from engine import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_lora_rank=16)
    prompt = make_prompts(1, seed=12, min_len=10, max_len=10)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    lora = SimpleNamespace(lora_name="mlp", lora_int_id=1, lora_path=str(adapters["mlp"]))
    (out,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    assert (
        out.outputs[0].token_ids
        == peft_greedy(tiny_model_dir, adapters["mlp"], [prompt], MAX_NEW)[0]
    )
    (again,) = llm.generate([prompt], params, use_tqdm=False, lora_request="mlp")
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.slow
def test_default_model_with_random_adapters_matches_peft(tmp_path):
    """The real default model (float32) with two random rank-16 adapters on all seven targets
    and the base in one batch: the greedy tokens equal PEFT's."""
    from engine import LLM
    from engine.model_loader.loader import resolve_model

    base_dir = resolve_model(None)
    paths = {
        f"r{seed}": build_adapter(base_dir, tmp_path / f"r{seed}", seed, 16, ATTN + MLP, std=0.05)
        for seed in (1, 2)
    }
    mods = tuple(f"{name}={path}" for name, path in paths.items())
    llm = LLM(None, dtype="float32", enable_lora=True, lora_modules=mods, max_loras=2)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    jobs = [(p, name) for name in (None, "r1", "r2") for p in prompts]
    for i, (prompt, name) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, lora_name=name)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            got.setdefault(int(out.request_id), []).extend(out.outputs[0].token_ids)
    for name in (None, "r1", "r2"):
        expected = peft_greedy(base_dir, paths.get(name), prompts, 12)
        assert [got[i] for i, job in enumerate(jobs) if job[1] == name] == expected, name
    assert got[2] != got[0]  # the adapter changes the tokens
