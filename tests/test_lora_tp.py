"""LoRA under tensor parallelism (two gloo ranks on CPU, the mp executor): adapters sharded like
their base linears give PEFT's and one rank's greedy float32 tokens in a batch mixing adapters
and the base model; adapters load, refuse and unload at runtime through the server in every
worker."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import ServerProcess, build_byte_tokenizer, make_prompts
from test_lora import ATTN, MAX_NEW, MLP, build_adapter, make_engine, peft_greedy, run
from test_tensor_parallel import build_case_dir

from engine.distributed import ParallelState


class _Slice:
    """A tensor as safetensors' get_slice serves it (the base linears' load_shard reads one)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        return self.t[index]


@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("rank", [0, 1])
def test_adapter_slices_follow_the_base_linears_shards(rank, num_kv_heads, monkeypatch):
    """At each rank B_rank @ A_rank is exactly the slice of B @ A that the base linear's own
    load_shard takes of a full weight (rows for q/k/v and gate/up, columns for o/down)."""
    import engine.distributed as distributed
    from engine.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from engine.lora.sharding import full_shape, shard_pair

    monkeypatch.setattr(distributed, "_STATE", ParallelState(rank=rank, world_size=2))
    qkv = QKVParallelLinear(64, 16, 4, num_kv_heads, False)
    gate_up = MergedColumnParallelLinear(64, 128)
    o, down = RowParallelLinear(64, 64), RowParallelLinear(128, 64)
    cases = [
        ("q_proj", qkv, "q", qkv.q_size), ("k_proj", qkv, "k", qkv.kv_size),
        ("v_proj", qkv, "v", qkv.kv_size), ("o_proj", o, None, 64),
        ("gate_proj", gate_up, "gate_proj", gate_up.part_size),
        ("up_proj", gate_up, "up_proj", gate_up.part_size), ("down_proj", down, None, 64),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    for hf, lin, part, size in cases:
        n_in, n_out = full_shape(hf, lin, size)
        assert (n_in, n_out) == {"q_proj": (64, 64), "k_proj": (64, 16 * num_kv_heads),
                                 "v_proj": (64, 16 * num_kv_heads), "o_proj": (64, 64),
                                 "down_proj": (128, 64)}.get(hf, (64, 128))  # fmt: skip
        a, b = torch.randn(8, n_in, generator=gen), torch.randn(n_out, 8, generator=gen)
        a_rank, b_rank = shard_pair(hf, lin, a, b)
        want = lin.load_shard("weight", part, _Slice(b @ a))
        torch.testing.assert_close(b_rank @ a_rank, want, msg=hf)


@pytest.fixture(scope="module")
def tp_base(tmp_path_factory):
    # vocab 260 and 2 KV heads: q, k, v and the vocabulary all split over two ranks
    return build_case_dir(tmp_path_factory.mktemp("lora-tp") / "llama", "llama")


def test_two_ranks_mixed_adapters_match_peft_and_one_rank(tp_base, tmp_path):
    root = tmp_path / "loras"
    adapters = {
        "attn": build_adapter(tp_base, root / "attn", 31, 8, ATTN, lora_alpha=16),
        "mlp": build_adapter(tp_base, root / "mlp", 32, 4, MLP, lora_alpha=8),
        "all-rs": build_adapter(
            tp_base, root / "all-rs", 33, 16, ATTN + MLP, lora_alpha=8, use_rslora=True
        ),
    }
    prompt = make_prompts(1, seed=7, min_len=13, max_len=13)[0]  # 3 full blocks + 1
    names = [None, "attn", "mlp", "all-rs"]
    expected = [
        peft_greedy(tp_base, adapters[n] if n else None, [prompt], MAX_NEW)[0] for n in names
    ]
    assert len({tuple(t) for t in expected}) == 4  # each adapter changes the tokens
    # 2 slots for 3 adapters, and only 2 kept in memory: each worker evicts and re-reads
    kw = dict(max_loras=2, max_cpu_loras=2)
    one = make_engine(tp_base, adapters, **kw)
    got_one, _ = run(one, [(prompt, n) for n in names])
    assert got_one == expected
    two = make_engine(tp_base, adapters, tensor_parallel_size=2, **kw)
    try:
        assert two.config.distributed_executor_backend == "mp"
        got, cached = run(two, [(prompt, n) for n in names])
        assert got == expected
        again, cached = run(two, [(prompt, n) for n in reversed(names)])
        assert again == expected[::-1]
        assert cached == [12, 12, 12, 12]  # each hits only its own adapter's blocks
        kv = two.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks
    finally:
        two.shutdown()


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    # one KV head: every rank holds the whole k/v rows of the adapter (a replicated head)
    root = tmp_path_factory.mktemp("lora-tp-server")
    base = build_case_dir(root / "llama-1kv", "llama-1kv-tied")
    server = ServerProcess(
        str(base),
        "--dtype", "float32", "--served-model-name", "tiny", "--api-key", "sekret",
        "--tensor-parallel-size", "2", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "8",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip
    server.base, server.root = base, root
    yield server.wait_ready()
    server.stop()


def test_load_refuse_and_unload_at_two_ranks_through_the_server(tp_server):
    url, root, base = tp_server.url, tp_server.root, tp_server.base
    auth = {"Authorization": "Bearer sekret"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    a = build_adapter(base, root / "a", 41, 8, ATTN, lora_alpha=16)
    b = build_adapter(base, root / "b", 42, 4, ATTN + MLP, lora_alpha=8)
    big = build_adapter(base, root / "big", 43, 16, ATTN)
    tok = build_byte_tokenizer()
    prompt = "sharded adapters"
    ids = tok(prompt)["input_ids"]

    def complete(model: str) -> str:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )  # fmt: skip
        return out.choices[0].text

    def load(name, path, **kw):
        body = {"lora_name": name, "lora_path": str(path), **kw}
        return httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth, timeout=120)

    def expect(adapter) -> str:
        return tok.decode(peft_greedy(base, adapter, [ids], MAX_NEW)[0])

    assert load("live", a).status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "live"]
    assert complete("live") == expect(a)
    r = load("live", big, load_inplace=True)  # r=16 > --max-lora-rank 8: refused in the workers
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "big/adapter_config.json: r=16 exceeds --max-lora-rank 8" in r.json()["error"]["message"]
    assert complete("live") == expect(a)  # the old weights still serve
    assert load("live", b, load_inplace=True).status_code == 200  # new weights, same name
    assert complete("live") == expect(b) != expect(a)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "live"}, headers=auth)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete("live")
    assert complete("tiny") == expect(None)
    assert httpx.get(url + "/health").status_code == 200  # the workers kept serving


@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("rank", [0, 1])
def test_fused_phi3_adapter_slices_follow_the_fused_base_shards(rank, num_kv_heads, monkeypatch):
    """Phi-3's fused qkv_proj / gate_up_proj: one PEFT pair over the whole fused module; at each
    rank B_rank @ A is the slice of B @ A that the base linear's load_shard takes of a weight
    stored fused (q, k, v and gate, up each cut on their own, stacked again)."""
    import engine.distributed as distributed
    from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from engine.lora.sharding import full_shape, shard_pair

    monkeypatch.setattr(distributed, "_STATE", ParallelState(rank=rank, world_size=2))
    qkv = QKVParallelLinear(64, 16, 4, num_kv_heads, False)
    gate_up = MergedColumnParallelLinear(64, 128)
    cases = [
        ("qkv_proj", qkv, qkv.q_size + 2 * qkv.kv_size, 64 + 2 * 16 * num_kv_heads),
        ("gate_up_proj", gate_up, 2 * gate_up.part_size, 256),
    ]
    gen = torch.Generator().manual_seed(10 + rank)
    for hf, lin, size, full_out in cases:
        assert full_shape(hf, lin, size) == (64, full_out), hf
        a, b = torch.randn(8, 64, generator=gen), torch.randn(full_out, 8, generator=gen)
        a_rank, b_rank = shard_pair(hf, lin, a, b)
        assert b_rank.shape == (size, 8), hf
        want = lin.load_shard("weight", None, _Slice(b @ a))
        torch.testing.assert_close(b_rank @ a_rank, want, msg=hf)


PHI3_FUSED = ["qkv_proj", "gate_up_proj"]


def test_phi3_fused_targets_at_two_ranks_match_peft_and_one_rank(tmp_path):
    """A tiny random Phi-3 (q/k/v and gate/up fused, as in its HF class): adapters on the fused
    modules and on o/down give PEFT's greedy float32 tokens at one and at two ranks, mixed with
    each other and the base model in one batch."""
    base = build_case_dir(tmp_path / "phi3", "phi3")
    root = tmp_path / "loras"
    adapters = {
        "fused": build_adapter(base, root / "fused", 51, 8, PHI3_FUSED, lora_alpha=16),
        "od": build_adapter(base, root / "od", 52, 4, ["o_proj", "down_proj"], lora_alpha=8),
        "all-rs": build_adapter(
            base, root / "all-rs", 53, 8, PHI3_FUSED + ["o_proj", "down_proj"], use_rslora=True
        ),
    }
    prompt = make_prompts(1, seed=8, min_len=11, max_len=11)[0]
    names = [None, "fused", "od", "all-rs"]
    expected = [peft_greedy(base, adapters[n] if n else None, [prompt], MAX_NEW)[0] for n in names]
    assert len({tuple(t) for t in expected}) == 4  # each adapter changes the tokens
    kw = dict(max_loras=3)
    got_one, _ = run(make_engine(base, adapters, **kw), [(prompt, n) for n in names])
    assert got_one == expected
    two = make_engine(base, adapters, tensor_parallel_size=2, **kw)
    try:
        got, _ = run(two, [(prompt, n) for n in names])
        assert got == expected
    finally:
        two.shutdown()


def test_a_workers_refusal_is_the_exception_one_process_raises():
    """A worker's (type name, message) comes back as the engine's own exception: a missing
    folder stays a 404 at the server, any other refusal a 400, anything else a RuntimeError."""
    from engine.lora.request import LoRAError, LoRAFolderNotFoundError
    from engine.lora.workers import raise_lora_error

    raise_lora_error(None)
    with pytest.raises(LoRAFolderNotFoundError, match="^/x: no such"):
        raise_lora_error(("LoRAFolderNotFoundError", "/x: no such LoRA adapter folder"))
    with pytest.raises(LoRAError) as e:
        raise_lora_error(("LoRAError", "r=16 exceeds"))
    assert type(e.value) is LoRAError
    with pytest.raises(RuntimeError, match="KeyError: boom"):
        raise_lora_error(("KeyError", "boom"))
