"""Every registered family against transformers on tiny random weights built from its own config
class: greedy tokens equal generate's in float32 (alone, batched with other lengths, chunked
prefill, prefix-cache hits, preemption), bf16 close to float32, start-up refusals in one line."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import build_byte_tokenizer, hf_greedy, make_prompts

from engine import LLM, SamplingParams
from engine.models import SUPPORTED_ARCHITECTURES

MAX_NEW = 12


def longrope(head_dim: int) -> dict:
    """Phi-3's longrope scaling with one factor per rotary frequency (head_dim / 2 of them)."""
    n = head_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(n)],
        "long_factor": [2.0 + 0.2 * i for i in range(n)],
        "original_max_position_embeddings": 512,
    }


_PHI3 = {"pad_token_id": 0, "original_max_position_embeddings": 512}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# family -> (config class, model class, config overrides): GQA everywhere (4 heads, 2 kv heads)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": _LLAMA3}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Phi3Config's own original_max_position_embeddings (4096) overrides the rope dict's: set
    # both, so max_position_embeddings / 512 = 2 scales cos and sin as longrope does
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_PHI3, "rope_scaling": longrope(16)}),
    # Phi-3-mini's head shape (MHA, head_dim 96 = hidden / heads) on 4 heads: the CPU attention
    # kernels' head_dim 96 paths
    "phi3-d96": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {**_PHI3, "rope_scaling": longrope(96), "hidden_size": 384, "num_key_value_heads": 4},
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        # 16 experts, 2 per token: a short decode batch leaves most experts without a token
        {"head_dim": 32, "moe_intermediate_size": 32, "num_experts": 16,
         "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1]},
    ),
}


# Llama's other rope scalings: float32 batched parity only (the engine paths are the same)
ROPE_VARIANTS = {
    "llama-linear": {"rope_type": "linear", "factor": 2.0},
    "llama-dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}
FAMILIES.update(
    {k: ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": v}) for k, v in ROPE_VARIANTS.items()}
)
MAIN_FAMILIES = [f for f in FAMILIES if f not in ROPE_VARIANTS]


def build_family_dir(path, family: str, seed: int = 0, **changes):
    """A tiny random-weight model of `family` saved as a Hugging Face folder; `changes` override
    its config further (bench/model_families.py builds real-sized heads this way)."""
    import torch
    import transformers

    cfg_name, model_name, overrides = FAMILIES[family]
    tokenizer = build_byte_tokenizer()
    cfg = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg.update(overrides)
    cfg.update(changes)
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**cfg)
    model = getattr(transformers, model_name)(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6, seed=5, max_len=40)


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variant_batched_matches_transformers(variant, tmp_path, prompts):
    path = build_family_dir(tmp_path / variant, variant)
    llm = LLM(str(path), dtype="float32")
    assert _tokens(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=MAIN_FAMILIES)
def family(request, tmp_path_factory, prompts):
    """(name, folder, transformers' greedy tokens): one model per family per module."""
    path = build_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, hf_greedy(path, prompts, MAX_NEW)


def test_architecture_is_registered(family):
    name, path, _ = family
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert arch in SUPPORTED_ARCHITECTURES


def test_alone_batched_and_prefix_hits_match_transformers(family, prompts):
    name, path, expected = family
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert _tokens(llm, prompts[:1]) == expected[:1]  # alone
    assert _tokens(llm, prompts) == expected  # batched with prompts of other lengths
    warm = llm.generate(prompts, _greedy(), use_tqdm=False)  # same prompts: prefix-cache hits
    assert [o.outputs[0].token_ids for o in warm] == expected
    assert sum(o.num_cached_tokens for o in warm) > 0
    _assert_all_free(llm)


def test_chunked_prefill_and_preemption_match_transformers(family, prompts):
    name, path, expected = family
    # a 7-token budget cuts every prompt into chunks; 8 blocks of 8 force recompute preemption
    llm = LLM(
        str(path), dtype="float32", max_num_batched_tokens=7, block_size=8,
        num_gpu_blocks_override=8,
    )
    assert _tokens(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    _assert_all_free(llm)


def test_moe_skips_experts_without_tokens(tmp_path_factory, prompts, monkeypatch):
    import torch

    from engine.layers import Experts

    path = build_family_dir(tmp_path_factory.mktemp("moe-idle"), "qwen3-moe", seed=3)
    expected = hf_greedy(path, prompts[:1], MAX_NEW)
    llm = LLM(str(path), dtype="float32")
    seen: list[int] = []
    original = torch.nn.functional.linear
    calls = {"n": 0, "active": False}

    def spy(self, x, expert_ids, weights):
        seen.append(len(set(expert_ids.flatten().tolist())))
        calls.update(n=0, active=True)
        try:
            out = Experts.forward_native(self, x, expert_ids, weights)
        finally:
            calls["active"] = False
        assert calls["n"] == 2 * seen[-1]  # two GEMMs per expert that got a token, none else
        return out

    def counting_linear(*args, **kwargs):
        calls["n"] += calls["active"]
        return original(*args, **kwargs)

    for module in llm.engine.runner.model.modules():
        if isinstance(module, Experts):
            monkeypatch.setattr(module, "forward", spy.__get__(module))
    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    assert _tokens(llm, prompts[:1]) == expected
    assert seen and min(seen) < 16  # decode steps route one token to 2 of 16 experts


def test_bf16_close_to_float32(family, prompts):
    """bf16 serving: the first greedy token of most prompts equals float32's, and every bf16
    run stays complete (tolerance: bf16 rounds weights to 8 bits, so later tokens may drift)."""
    name, path, expected = family
    llm = LLM(str(path), dtype="bfloat16")
    got = _tokens(llm, prompts)
    agree = sum(g[0] == e[0] for g, e in zip(got, expected))
    assert agree >= len(prompts) - 1, (name, got, expected)
    assert all(len(g) == MAX_NEW for g in got)
    _assert_all_free(llm)


def test_bf16_decodes_on_the_cpu_fast_path(family, prompts):
    """Where the AMX kernels run, every decode-only step of a dense family (Phi-3's longrope and
    fused checkpoints included) takes the fused decode step, and the MoE experts bind to the
    expert kernel: a family off the fast path fails here, not only as a slow benchmark row."""
    from engine.layers import Experts
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None or not ops.amx_available():
        pytest.skip("the CPU fast path needs the C++ kernels with AMX")
    name, path, expected = family
    llm = LLM(str(path), dtype="bfloat16")
    runner = llm.engine.runner
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    if experts:
        assert all(m.impl == "cpu" for m in experts), name
        assert len(_tokens(llm, prompts)) == len(prompts)
        return
    fused = runner.fused_decode
    assert fused is not None, f"{name} declined the fused decode step"
    taken = {"n": 0}
    run = fused.run

    def counting_run(*args, **kwargs):
        taken["n"] += 1
        return run(*args, **kwargs)

    fused.run = counting_run
    _tokens(llm, prompts[:3])  # one prefill step, then MAX_NEW - 1 decode-only steps
    assert taken["n"] == MAX_NEW - 1, name


def test_phi3_head_dim_96_attention_runs_the_amx_kernels(tmp_path_factory, prompts):
    """Phi-3's head_dim 96 in bf16: every prefill layer calls the AMX prefill kernel, the decode
    attention inside the fused step is the AMX decode kernel (ops.decode_kernel on the model's
    own cache), as for Llama's head_dim 64 and 128; tokens stay complete."""
    import torch

    from pagedserve_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None or not ops.amx_available():
        pytest.skip("the CPU fast path needs the C++ kernels with AMX")
    path = build_family_dir(tmp_path_factory.mktemp("phi3-d96-bf16"), "phi3-d96")
    llm = LLM(str(path), dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.head_dim == 96
    backend = runner.backend
    calls: list[str] = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            return lambda *args: (calls.append(name), fn(*args))[1]

    backend.ops = Spy()
    got = _tokens(llm, prompts[:3])
    assert all(len(g) == MAX_NEW for g in got)
    layers = runner.num_layers
    assert calls.count("paged_attention_prefill") == layers  # one prefill step, one call a layer
    k_cache = runner.kv_caches[0][0]
    for batch in (1, 3, 8):  # per KV head and per sequence
        q = torch.empty(batch, 4, 96, dtype=torch.bfloat16)
        assert ops.decode_kernel(q, k_cache) == "amx", batch
    assert runner.fused_decode is not None


# ---- start-up refusals -----------------------------------------------------------------------
def _edit_config(tmp_path, family: str, **changes):
    path = build_family_dir(tmp_path / family, family)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unknown_architecture_is_refused_naming_it(tmp_path):
    path = _edit_config(tmp_path, "qwen2", architectures=["Qwen9ForCausalLM"])
    with pytest.raises(ValueError) as e:
        LLM(str(path), dtype="float32")
    msg = str(e.value)
    assert "Qwen9ForCausalLM" in msg and "\n" not in msg
    assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_refused_naming_it(tmp_path):
    rope = {"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0}
    path = _edit_config(tmp_path, "mistral", rope_scaling=rope, rope_parameters=rope)
    with pytest.raises(ValueError) as e:
        LLM(str(path), dtype="float32")
    msg = str(e.value)
    assert "'proportional'" in msg and "llama3" in msg and "longrope" in msg and "\n" not in msg


def test_mistral_sliding_window_is_served(tmp_path, prompts):
    """A set sliding_window is served windowed (tests/test_gemma.py covers the paths)."""
    path = _edit_config(tmp_path, "mistral", sliding_window=32)
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    assert llm.engine.runner.kv_cache_spec.windows == (32,)
    assert _tokens(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
    # a window no shorter than max_model_len hides nothing: served as full attention
    llm = LLM(str(path), dtype="float32", max_model_len=32)
    assert llm.engine.runner.kv_cache_spec.windows == (0,)


def test_every_declared_eos_id_stops(tmp_path, prompts):
    path = build_family_dir(tmp_path / "llama3", "llama3")
    free = _tokens(LLM(str(path), dtype="float32"), prompts[:1])[0]
    # generation_config.json declares a second EOS (as Llama 3's several do)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    gen = {"eos_token_id": [eos, free[3]], "temperature": 0.0, "top_k": 5}
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.eos_token_ids == {eos, free[3]}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    out = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"
    # generation_config defaults fill a request that sets nothing (offline API: no params)
    assert llm.engine.default_sampling_params().top_k == 5
    default_out = llm.generate(prompts[:1], use_tqdm=False)[0].outputs[0]
    assert default_out.token_ids == free[: len(default_out.token_ids)]  # temperature 0: greedy
    # ... and the server's requests too: the facade hands them to the serving context
    from engine.async_engine import AsyncEngine
    from server.openai.protocol import ChatCompletionRequest, CompletionRequest
    from server.openai.serving import ServingContext, to_sampling_params

    ctx = ServingContext.build(AsyncEngine(llm.engine))
    unset = to_sampling_params(CompletionRequest(prompt="x"), defaults=ctx.generation_defaults)
    assert (unset.temperature, unset.top_k) == (0.0, 5)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.7)
    chosen = to_sampling_params(chat, defaults=ctx.generation_defaults)
    assert (chosen.temperature, chosen.top_k) == (0.7, 5)  # the request's own value wins


def test_registry_has_what_the_readme_lists():
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
    }


# ---- through the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    from conftest import ServerProcess

    path = build_family_dir(tmp_path_factory.mktemp("qwen3-server"), "qwen3")
    server = ServerProcess(str(path), "--dtype", "float32", "--served-model-name", "q3")
    server.wait_ready()
    yield server, path
    server.stop()
    shutil.rmtree(path, ignore_errors=True)


def test_openai_client_completions_and_chat_on_qwen3(qwen3_server, prompts):
    import openai

    server, path = qwen3_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    expected = hf_greedy(path, prompts[:1], MAX_NEW)[0]
    tokenizer = build_byte_tokenizer()
    kw = dict(model="q3", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
    done = client.completions.create(prompt=prompts[0], **kw)
    assert done.usage.completion_tokens == MAX_NEW
    want_text = tokenizer.decode(expected)
    assert done.choices[0].text == want_text
    streamed = client.completions.create(prompt=prompts[0], stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want_text
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chat_want = tokenizer.decode(hf_greedy(path, [chat_ids], MAX_NEW)[0])
    chat = client.chat.completions.create(messages=messages, **kw)
    assert chat.choices[0].message.content == chat_want
    stream = client.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_want
