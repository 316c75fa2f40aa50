"""Causal embedders on the shared scheduler (engine/pooling_llm.py): pooling requests chunked
under the token budget, beside each other, prefix-cached for last-token pooling (mean pooling
skips the lookup), preempted and resumed; every vector equals sentence-transformers' (cosine
>= 0.9999, float32) and no KV block or runner state is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.pooling_llm import build_pooling_llm_engine, make_pooling_request, pools_on_scheduler
from engine.runner.pooling_runner import finish_embedding
from tests.test_pooling import TEXTS, build_tiny_qwen3_embedder

BUDGET = 32  # tokens per step: the 540-token input runs over at least 17 steps


@pytest.fixture(scope="module", params=["lasttoken", "mean_tokens"])
def embedder(request, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """(model folder, sentence-transformers' vectors of TEXTS) per pooling."""
    from sentence_transformers import SentenceTransformer

    path = tmp_path_factory.mktemp(f"qwen3-embed-{request.param}")
    model_dir = build_tiny_qwen3_embedder(path, pooling=request.param, seed=5)
    st = SentenceTransformer(str(model_dir), device="cpu")
    return model_dir, st.encode(TEXTS, convert_to_tensor=True).float()


def _engine(model_dir: Path, num_blocks: int = 64):
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=BUDGET,
        num_gpu_blocks_override=num_blocks,
    )
    return build_pooling_llm_engine(config)


def _run(engine, prompts: dict[str, list[int]]):
    """Adds every prompt at once, steps to the end: (vectors by id, the steps' stats, each
    step's number of scheduled requests)."""
    sizes, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: _counted(schedule(), sizes)
    for rid, ids in prompts.items():
        engine.add(make_pooling_request(engine, rid, ids, engine.pooling.pooling_type))
    vecs, stats = {}, []
    while engine.has_unfinished_requests():
        outputs, step = engine.step()
        stats.append(step)
        for out in outputs:
            assert out.outputs[0].token_ids == []  # nothing is ever sampled
            if out.finished:
                assert out.outputs[0].finish_reason == "stop"
                vecs[out.request_id] = finish_embedding(out.pooled_output, True, None)
    engine.scheduler.schedule = schedule
    return vecs, stats, sizes


def _counted(out, sizes: list[int]):
    sizes.append(len(out.requests))
    return out


def _assert_matches(vec: torch.Tensor, ref: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(vec, ref, dim=0).item()
    assert cos >= 0.9999, cos


def _assert_nothing_left(engine) -> None:
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks  # cached blocks are free too
    assert not engine.scheduler.requests and not engine.scheduler.running
    engine.step()  # the runner hears of the last finished ids on the next step
    runner = engine.runner
    assert not runner.pooler.partial and not runner.block_tables.row_of


def _ids(engine, texts):
    return {f"r{i}": engine.tokenizer(t)["input_ids"] for i, t in enumerate(texts)}


def test_chunked_prefill_beside_other_requests(embedder):
    model_dir, ref = embedder
    engine = _engine(model_dir)
    prompts = _ids(engine, TEXTS)
    assert len(prompts["r1"]) > 16 * BUDGET
    vecs, stats, sizes = _run(engine, prompts)
    assert all(s.num_scheduled_tokens <= BUDGET for s in stats)
    assert len(stats) >= len(prompts["r1"]) // BUDGET  # the long input spans many steps
    assert max(sizes) >= 2  # the short ones ran beside it
    for i in range(len(TEXTS)):
        _assert_matches(vecs[f"r{i}"], ref[i])
    _assert_nothing_left(engine)


def test_prefix_cache_hit_for_last_token_only(embedder):
    """The same long input again, beside other inputs: last-token pooling hits the cached
    blocks (the last token is still computed); mean pooling looks nothing up and recomputes
    every position."""
    model_dir, ref = embedder
    engine = _engine(model_dir)
    prompts = _ids(engine, TEXTS)
    ids, others = prompts["r1"], {"r0": prompts["r0"], "r2": prompts["r2"]}
    first, _, _ = _run(engine, {"a": ids})
    second, stats, sizes = _run(engine, {"b": ids, **others})
    num_others = sum(map(len, others.values()))
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    scheduled = sum(s.num_scheduled_tokens for s in stats)
    if engine.pooling.pooling_type == "LAST":
        assert hits >= len(ids) - 16 and queries == len(ids) + num_others
        assert scheduled <= 16 + num_others  # of the long input only its last block ran
        assert sizes[0] == 3  # the hit and the others in one step
    else:
        assert engine.pooling.pooling_type == "MEAN"
        assert queries == 0 and hits == 0
        assert scheduled == len(ids) + num_others
    for vec in (first["a"], second["b"]):
        _assert_matches(vec, ref[1])
    _assert_matches(second["r0"], ref[0])
    _assert_matches(second["r2"], ref[2])
    _assert_nothing_left(engine)


def test_preempted_request_pools_from_scratch(embedder):
    """A request preempted mid-prompt (the scheduler's own recompute preemption, forced here:
    FCFS prefill-only batches rarely run short of blocks) is recomputed from position 0, and
    its pooling restarts with it."""
    from engine.core.scheduler_output import SchedulerOutput

    model_dir, ref = embedder
    engine = _engine(model_dir)
    prompts = _ids(engine, TEXTS)
    for rid, ids in prompts.items():
        engine.add(make_pooling_request(engine, rid, ids, engine.pooling.pooling_type))
    for _ in range(5):
        engine.step()
    sched = engine.scheduler
    long_req = sched.requests["r1"]
    assert 0 < long_req.num_computed_tokens < long_req.num_tokens
    sched.running.remove(long_req)
    sched._preempt(long_req, SchedulerOutput())  # noqa: SLF001
    vecs, _, _ = _run(engine, {})
    assert sched.num_preemptions_total == 1
    for i in (1, 2, 3):
        _assert_matches(vecs[f"r{i}"], ref[i])
    _assert_nothing_left(engine)


def test_refusals_and_routing(embedder, tiny_model_dir):
    from engine.core.request import RequestRejectedError

    model_dir, _ = embedder
    engine = _engine(model_dir)
    with pytest.raises(RequestRejectedError, match="maximum context length") as err:
        make_pooling_request(engine, "long", [1] * (engine.config.max_model_len + 1), "LAST")
    assert err.value.param == "input"
    with pytest.raises(RequestRejectedError, match="vocabulary"):
        make_pooling_request(engine, "bad", [engine.vocab_size], "LAST")
    assert not engine.scheduler.requests
    assert pools_on_scheduler(str(model_dir))
    assert not pools_on_scheduler(str(model_dir), {"classifier_from_token": ["no", "yes"]})
