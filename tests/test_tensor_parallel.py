"""Tensor parallelism on CPU (gloo, loopback): greedy tokens at two ranks equal one rank's and
transformers' in float32, under batching, chunked prefill, prefix hits and preemption, for every
way a layer shards (split and replicated KV heads, tied embeddings, fused checkpoints, experts);
each rank reads only its slice of a sharded tensor."""

from __future__ import annotations

import pytest
import torch
from conftest import build_byte_tokenizer, hf_greedy, make_prompts
from test_model_families import FAMILIES

from engine import LLM, SamplingParams
from engine.distributed import ParallelState

MAX_NEW = 10
# vocab 260: the byte tokenizer's 259 ids padded so the vocabulary splits over two ranks
CASES = {
    "llama": ("llama3", {}),
    "llama-1kv-tied": ("llama3", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "phi3": ("phi3", {}),  # q/k/v and gate/up stored fused
}


def build_case_dir(path, case: str, seed: int = 0):
    import transformers

    family, extra = CASES[case]
    cfg_name, model_name, overrides = FAMILIES[family]
    tokenizer = build_byte_tokenizer()
    cfg = dict(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    cfg.update(overrides)
    cfg.update(extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**cfg))
    model.float().eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    shared = make_prompts(1, seed=9, min_len=20, max_len=20)[0]  # a common prefix: cache hits
    tails = make_prompts(2, seed=6, max_len=20)
    return make_prompts(4, seed=5, max_len=30) + [shared + p for p in tails]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_rank_and_transformers(case, prompts, tmp_path):
    path = build_case_dir(tmp_path / case, case)
    expected = hf_greedy(path, prompts, MAX_NEW)
    # a 7-token budget chunks every prompt; 8 blocks of 8 force recompute preemption
    kw = dict(dtype="float32", max_num_batched_tokens=7, block_size=8, num_gpu_blocks_override=8)
    one = LLM(str(path), **kw)
    assert _tokens(one, prompts) == expected
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.config.distributed_executor_backend == "mp"
        assert _tokens(two, prompts) == expected
        assert two.engine.scheduler.num_preemptions_total > 0
        two.generate(prompts[-1:], _greedy(), use_tqdm=False)
        warm = two.generate(prompts[-1:], _greedy(), use_tqdm=False)  # its blocks are cached
        assert warm[0].num_cached_tokens > 0
        assert warm[0].outputs[0].token_ids == expected[-1]
        pool = two.engine.scheduler.kv_cache_manager.block_pool
        pool.check_integrity()
        assert pool.get_num_free_blocks() == pool.num_blocks
    finally:
        two.engine.shutdown()


def test_each_rank_reads_only_its_slice(tmp_path, monkeypatch):
    """Rank 1 of 2, built in-process (no collective runs at load): sharded tensors come from
    get_slice with this rank's rows or columns, replicated ones whole."""
    import safetensors
    from safetensors.torch import load_file

    import engine.distributed as distributed
    import engine.model_loader.weight_loader as weight_loader
    from engine.models import get_model_class
    from pagedserve_kernels import get_attention_backend

    path = build_case_dir(tmp_path / "llama", "llama-1kv-tied")
    full = load_file(next(path.glob("*.safetensors")))
    whole: list[str] = []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = safetensors.safe_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weight_loader, "safe_open", Spy)
    monkeypatch.setattr(distributed, "_STATE", ParallelState(rank=1, world_size=2))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    model = get_model_class(cfg)(cfg, get_attention_backend("torch", "cpu", 8, torch.float32))
    state, _ = weight_loader.read_weights(path, model)
    assert all("norm" in n for n in whole) and whole  # only the replicated norms read whole
    layer = "model.layers.0"
    d = 16  # head_dim
    q = full[f"{layer}.self_attn.q_proj.weight"]
    torch.testing.assert_close(state[f"{layer}.self_attn.q_proj.weight"], q[2 * d : 4 * d])
    k = full[f"{layer}.self_attn.k_proj.weight"]  # one KV head: replicated on both ranks
    torch.testing.assert_close(state[f"{layer}.self_attn.k_proj.weight"], k)
    down = full[f"{layer}.mlp.down_proj.weight"]
    torch.testing.assert_close(state[f"{layer}.mlp.down_proj.weight"], down[:, 64:])
    emb = full["model.embed_tokens.weight"]
    torch.testing.assert_close(state["model.embed_tokens.weight"], emb[130:])
    weight_loader.check_shapes(model, state, {})  # the slices fit this rank's parameters
    missing, unexpected = model.load_weights(state)
    assert not missing and not unexpected
    assert model.model.layers[0].self_attn.num_heads == 2
    assert model.model.layers[0].self_attn.num_kv_heads == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_two_gpus_over_nccl_match_one(prompts, tmp_path):
    path = build_case_dir(tmp_path / "llama", "llama")
    kw = dict(dtype="float32", device="cuda", enforce_eager=True)
    one = _tokens(LLM(str(path), **kw), prompts)
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.executor.device.type == "cuda"
        assert _tokens(two, prompts) == one
    finally:
        two.engine.shutdown()
