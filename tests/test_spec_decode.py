"""N-gram speculative decoding (engine/spec_decode/ngram.py): exact greedy output, sampled
output from the target distribution, KV rollback, stop rules, logprobs and
metrics (float32, tiny models)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    CYCLE_TEXT,
    ServerProcess,
    build_byte_tokenizer,
    hf_greedy,
    make_prompts,
    metric_value,
)

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.request import Request
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler, sampling_probs
from engine.spec_decode.ngram import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip
BLOCK_SIZE = 4
MAX_STEPS = 2000


# ---- config --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, key",
    [
        ("{not json", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "prompt_lookup_min"),  # fmt: skip
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "draft_model"),
    ],
)
def test_config_refuses_bad_values_naming_the_key(value, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=value)


def test_config_defaults_follow_vllm_and_refuses_multiprocess():
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert spec.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
    one = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                  '"prompt_lookup_max": 3}')  # fmt: skip
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    with pytest.raises(ValueError, match="speculative_config is not supported with tensor"):
        EngineConfig(speculative_config=SPEC, tensor_parallel_size=2)


def test_cli_refuses_bad_speculative_config_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": -1}'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pagedserve: error: speculative_config.num_speculative_tokens must be an integer >= 1, "
        "got -1"
    ]


# ---- proposer ------------------------------------------------------------------------------
def _proposer(k=3, n_max=3, n_min=1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, n_max, n_min))


def test_proposer_takes_the_longest_suffix_match():
    # suffix [1, 2] matches at 0 (followed by 9 8 7) and, as a 1-gram, "2" also after 5
    assert _proposer().propose([1, 2, 9, 8, 7, 5, 2, 6, 1, 2]) == [9, 8, 7]
    assert _proposer(n_min=3).propose([1, 2, 9, 8, 7, 5, 2, 6, 1, 2]) == []  # no 3-gram match
    assert _proposer().propose([4, 5, 6]) == []
    assert _proposer().propose([1, 2, 3, 1, 2], max_drafts=2) == [3, 1]


def test_proposer_prefers_the_latest_match_with_k_tokens_after_it():
    tokens = [7, 1, 2, 3, 4, 9, 7, 5, 6, 8, 0, 7]
    assert _proposer(k=2, n_max=1).propose(tokens) == [5, 6]  # latest 7 with two after it
    assert _proposer(k=4, n_max=1).propose([7, 1, 2, 3, 4, 0, 7, 5, 7]) == [1, 2, 3, 4]
    assert _proposer(k=3, n_max=2).propose([3, 4, 3, 4]) == [3, 4]  # all there is after it


# ---- scheduler -----------------------------------------------------------------------------
def _spec_scheduler(num_blocks=32, group_windows=(0,)):
    from engine.core.scheduler import Scheduler

    cfg = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_model_len=256,
                       speculative_config=SPEC)  # fmt: skip
    return Scheduler(cfg, num_blocks, group_windows)


def test_scheduler_refuses_sliding_window_groups():
    with pytest.raises(ValueError, match="not supported with sliding-window"):
        _spec_scheduler(group_windows=(0, 8))


def test_rejected_drafts_give_their_blocks_back():
    from engine.outputs import ModelRunnerOutput

    sched = _spec_scheduler()
    kv = sched.kv_cache_manager
    req = Request("r", [1, 2, 3, 1, 2, 3, 1], SamplingParams(temperature=0.0, max_tokens=20))
    sched.add_request(req)
    out = sched.schedule()  # the prompt
    sched.update_from_output(out, ModelRunnerOutput([2]))
    out = sched.schedule()  # newest token 2 and the drafts after "3 1 2"
    assert out.spec_token_ids == {"r": [3, 1, 2]} and out.num_scheduled_tokens == [4]
    assert len(kv.get_block_ids("r")) == 3  # slots for positions 7..10
    sched.update_from_output(
        out, ModelRunnerOutput([2], spec_token_ids={"r": [3, 2]})  # one accepted, then 2
    )
    assert req.all_token_ids[7:] == [2, 3, 2] and req.num_computed_tokens == 9
    assert len(kv.get_block_ids("r")) == 3  # position 9 still needs the third block
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [3, 1, 2]}  # after the "2" at position 4
    assert len(kv.get_block_ids("r")) == 4  # positions 9..12
    sched.update_from_output(out, ModelRunnerOutput([5], spec_token_ids={"r": [5]}))
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    kv.check_integrity()
    assert len(kv.get_block_ids("r")) == 3  # cdiv(10, 4): the blocks of rejected slots freed
    assert kv.block_pool.get_num_free_blocks() == 32 - 3
    table = list(kv.get_block_ids("r"))
    out = sched.schedule()  # the runner's copy of the table is resent after the rollback
    assert out.block_table_reset == [True] and out.new_block_ids[0][:3] == tuple(table)


# ---- engine --------------------------------------------------------------------------------
def _check_hashes(engine) -> None:
    """Every cached block a running request holds covers verified tokens with their hash."""
    kv = engine.scheduler.kv_cache_manager
    for req in engine.scheduler.running:
        hashes = kv.req_to_block_hashes.get(req.request_id, [])
        for i, block in enumerate(kv.req_to_blocks.get(req.request_id, [])):
            if block.block_hash is not None:
                assert i < len(hashes) and block.block_hash == hashes[i], (req.request_id, i)
                assert (i + 1) * BLOCK_SIZE <= req.num_tokens


_ENGINES: dict[tuple, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_engines():
    yield
    _ENGINES.clear()


def make_engine(model_dir, spec=None, **engine_args):
    """One engine per (model, speculation, engine args) in this module, drained and with its
    prefix cache emptied before each reuse, so that every run starts as on a new engine."""
    key = (str(model_dir), json.dumps(spec, sort_keys=True), tuple(sorted(engine_args.items())))
    engine = _ENGINES.get(key)
    # a run that failed part-way leaves requests behind: that engine is not reused
    if engine is None or engine.has_unfinished_requests():
        args = dict(dtype="float32", block_size=BLOCK_SIZE) | engine_args
        engine = _ENGINES[key] = LLM(str(model_dir), speculative_config=spec, **args).engine
    assert engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    return engine


def run(model_dir, prompts, params, spec=None, abort_after=None, **engine_args):
    """Steps the engine to the end (checking the KV invariants every step); returns per request
    (token ids, text, finish reason, logprobs) and the spec counters (drafts, tokens, accepted)."""
    engine = make_engine(model_dir, spec, **engine_args)
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), ids, p)
    got = {str(i): [[], "", None, []] for i in range(len(prompts))}
    counters = [0, 0, 0, 0]  # drafts, draft tokens, accepted, preemptions
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        outputs, stats = engine.step()
        counters = [
            a + b
            for a, b in zip(
                counters,
                (stats.num_spec_drafts, stats.num_spec_draft_tokens,
                 stats.num_spec_accepted_tokens, stats.num_preemptions),
            )
        ]  # fmt: skip
        kv = engine.scheduler.kv_cache_manager
        kv.check_integrity()
        _check_hashes(engine)
        if abort_after is not None and counters[0] >= abort_after:
            outputs += engine.abort_request(list(engine.scheduler.requests))
            abort_after = None
        for out in outputs:
            entry, c = got[out.request_id], out.outputs[0]
            entry[0] += c.token_ids
            entry[1] += c.text
            entry[2] = c.finish_reason
            entry[3] += c.logprobs or []
    assert not engine.has_unfinished_requests(), "engine did not drain"
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "blocks leaked"
    assert not kv.req_to_blocks
    return [got[str(i)] for i in range(len(prompts))], counters


def _cycle_ids(text: str) -> list[int]:
    return build_byte_tokenizer().encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def repeat_prompts() -> list[list[int]]:
    """Random prompts said three times: the n-gram proposer finds drafts in them."""
    return [p * 3 for p in make_prompts(6, seed=1, min_len=3, max_len=8)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_equals_transformers_with_drafts_accepted_and_rejected(
    tiny_model_dir, cycle_model_dir, repeat_prompts
):
    # The random model rejects nearly every draft; the cycle model accepts most of its own.
    expected = hf_greedy(tiny_model_dir, repeat_prompts, 24)
    got, (drafts, tokens, accepted, _) = run(tiny_model_dir, repeat_prompts, GREEDY, SPEC)
    assert [g[0] for g in got] == expected
    assert drafts > 0 and accepted < tokens
    cycle_prompts = repeat_prompts + [_cycle_ids("xy" + CYCLE_TEXT * 2)]
    expected = hf_greedy(cycle_model_dir, cycle_prompts, 24)
    got, (drafts, tokens, accepted, _) = run(cycle_model_dir, cycle_prompts, GREEDY, SPEC)
    assert [g[0] for g in got] == expected
    assert 0 < accepted < tokens  # both accepted and rejected drafts ran


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=6),  # chunked prefill; drafts capped by the budget
        dict(max_num_seqs=2),  # drafted requests batched beside prefills
        dict(num_gpu_blocks_override=24),  # preemption by a tiny pool
    ],
    ids=["chunked", "batched", "preempted"],
)
def test_greedy_unchanged_by_spec_under_scheduling(cycle_model_dir, repeat_prompts, engine_args):
    prompts = repeat_prompts + [_cycle_ids(CYCLE_TEXT * 2)] * 2
    plain, _ = run(cycle_model_dir, prompts, GREEDY, None, **engine_args)
    got, counters = run(cycle_model_dir, prompts, GREEDY, SPEC, **engine_args)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert [g[1] for g in got] == [p[1] for p in plain]
    assert counters[2] > 0
    if "num_gpu_blocks_override" in engine_args:
        assert counters[3] > 0  # preemptions happened


def test_prefix_cache_hits_with_drafts(cycle_model_dir):
    """The same prompts twice in one engine: the second round hits blocks written under
    speculation, and its tokens are the same."""
    prompt = _cycle_ids("q" + CYCLE_TEXT * 3)
    engine = make_engine(cycle_model_dir, SPEC)
    rounds = []
    for r in range(2):
        engine.add_request(f"r{r}", prompt, GREEDY)
        tokens, cached = [], 0
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step()[0]:
                tokens += out.outputs[0].token_ids
                cached = out.num_cached_tokens
            engine.scheduler.kv_cache_manager.check_integrity()
            _check_hashes(engine)
        rounds.append((tokens, cached))
    assert rounds[0][0] == rounds[1][0] == hf_greedy(cycle_model_dir, [prompt], 24)[0]
    assert rounds[1][1] >= (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_abort_mid_speculation_leaks_no_block(cycle_model_dir, repeat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    got, counters = run(cycle_model_dir, repeat_prompts, params, SPEC, abort_after=3)
    assert counters[0] >= 3
    assert {g[2] for g in got} == {"abort"}  # run() asserted every block is free


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_an_accepted_run(cycle_model_dir, max_tokens):
    prompt = _cycle_ids(CYCLE_TEXT * 3)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain, _ = run(cycle_model_dir, [prompt], params)
    got, counters = run(cycle_model_dir, [prompt], params, SPEC)
    assert got[0][:3] == plain[0][:3] and len(got[0][0]) == max_tokens
    assert got[0][2] == "length"
    assert max_tokens <= 2 or counters[2] > 0  # the prefill gives the first token


@pytest.mark.parametrize(
    "params",
    [
        dict(stop=["世"]),
        dict(stop=["🎉世"], include_stop_str_in_output=True),
        dict(stop_token_ids=[_cycle_ids("世")[0]]),
        dict(stop_token_ids=[_cycle_ids("a")[0]], min_tokens=13),
    ],
    ids=["stop-string", "stop-string-included", "stop-token", "min-tokens"],
)
def test_stops_inside_an_accepted_run(cycle_model_dir, params):
    prompt = _cycle_ids(CYCLE_TEXT * 3 + "a")
    p = SamplingParams(temperature=0.0, max_tokens=40, **params)
    plain, _ = run(cycle_model_dir, [prompt], p)
    got, counters = run(cycle_model_dir, [prompt], p, SPEC)
    assert got[0][:3] == plain[0][:3]
    assert got[0][2] == "stop" and counters[2] > 0


def test_processors_see_the_drafts_before_each_position():
    """Penalties, logit_bias and min_tokens at draft position j count drafts 0..j-1 as output,
    exactly as j plain decode steps would: the verified tokens equal those of plain steps."""
    gen = torch.Generator().manual_seed(3)
    vocab, k = 12, 4
    logits = torch.randn(k + 1, vocab, generator=gen) * 0.5
    logits[:, 5] += 1.0  # a favourite that the penalties push down once it is output
    params = SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=0.6,
                            presence_penalty=0.3, repetition_penalty=1.4,
                            logit_bias={7: 0.2}, min_tokens=4, stop_token_ids=[2])  # fmt: skip
    logits[:, 2] += 2.0  # a stop token min_tokens holds back until the 4th output token
    req = Request("r", [1, 5, 3], params, eos_token_id=None)
    req.all_token_ids += [5, 9]
    plain, tokens = Sampler(torch.device("cpu")), []
    for j in range(k + 1):  # j plain decode steps, the tokens so far appended as output
        step = Request("r", [1, 5, 3], params, eos_token_id=None)
        step.all_token_ids += [5, 9] + tokens
        tokens += plain(logits[j : j + 1], [step]).sampled_token_ids
    stale = [plain(logits[j : j + 1], [req]).sampled_token_ids[0] for j in range(k + 1)]
    assert stale != tokens, "the logits must make the per-position output matter"
    out = RejectionSampler(Sampler(torch.device("cpu"))).verify(logits, [req], [tokens[:k]])
    assert out.token_ids == [tokens]


def test_logprobs_equal_to_plain_decoding(cycle_model_dir, repeat_prompts):
    prompts = repeat_prompts[:3] + [_cycle_ids(CYCLE_TEXT * 3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain, _ = run(cycle_model_dir, prompts, params)
    got, counters = run(cycle_model_dir, prompts, params, SPEC)
    assert counters[2] > 0
    for g, p in zip(got, plain):
        assert g[0] == p[0] and len(g[3]) == len(p[3]) == 16
        for a, b in zip(g[3], p[3]):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sampled_requests_run_drafts_and_finish(cycle_model_dir, repeat_prompts):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=5)
    got, counters = run(cycle_model_dir, repeat_prompts + [_cycle_ids(CYCLE_TEXT * 3)],
                        params, SPEC)  # fmt: skip
    assert all(len(g[0]) == 24 for g in got) and counters[2] > 0


# ---- rejection sampler ---------------------------------------------------------------------
def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "sampled a token of probability 0"
    expected = probs[keep].double() / probs[keep].double().sum() * float(counts.sum())
    return float(chisquare(counts[keep].double(), expected).pvalue)


@pytest.mark.parametrize(
    "sp",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8)],
    ids=["plain", "top-k", "top-p"],
)
def test_rejection_sampling_gives_the_target_distribution(sp):
    """Emitted tokens at positions 0 and 1 (given position 0 took the draft) follow the target's
    processed distribution there, whatever the draft."""
    torch.manual_seed(0)
    vocab, drafts = 6, [1, 4]
    logits = torch.tensor(
        [[1.0, 1.5, 2.0, -1.0, 0.0, 0.3], [0.2, 0.1, -0.5, 1.5, 1.8, 0.0], [0, 1, 2, 3, 4, 5.0]]
    )
    params = SamplingParams(max_tokens=8, **sp)
    target = sampling_probs(logits, [params] * 3)  # [3, vocab]
    sampler, n = RejectionSampler(Sampler(torch.device("cpu"))), 4000
    reqs = [Request(f"r{i}", [0], params) for i in range(n)]
    out = sampler.verify(logits.repeat(n, 1), reqs, [drafts] * n)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == drafts[0]])
    third = torch.tensor([t[2] for t in out.token_ids if t[:2] == drafts])
    assert all(len(t) == 1 or t[: len(t) - 1] == drafts[: len(t) - 1] for t in out.token_ids)
    for samples, row in ((first, 0), (second, 1), (third, 2)):
        assert len(samples) > 100
        counts = torch.bincount(samples, minlength=vocab)
        assert _chi_square_p(counts, target[row]) > 1e-3, (row, counts, target[row])


# ---- server --------------------------------------------------------------------------------
def test_spec_decode_metrics_through_the_server(cycle_model_dir):
    import httpx
    import openai

    server = ServerProcess(
        str(cycle_model_dir), "--dtype", "float32", "--served-model-name", "cycle",
        "--speculative-config", json.dumps(SPEC),
    ).wait_ready()  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        # n > 1 fans out into requests that share the prompt's blocks; each runs drafts
        done = client.completions.create(
            model="cycle", prompt=CYCLE_TEXT * 2, max_tokens=20, temperature=0, n=2, logprobs=1
        )
        expected = build_byte_tokenizer().decode(hf_greedy(cycle_model_dir, [
            _cycle_ids(CYCLE_TEXT * 2)], 20)[0])  # fmt: skip
        assert [c.text for c in done.choices] == [expected, expected]
        assert [len(c.logprobs.tokens) for c in done.choices] == [20, 20]
        assert done.usage.completion_tokens == 40
        deadline = time.monotonic() + 10
        while True:  # the step's stats reach /metrics just after its output
            text = httpx.get(server.url + "/metrics", timeout=10).text
            labels = {"model_name": "cycle"}
            drafts = metric_value(text, "vllm:spec_decode_num_drafts_total", labels)
            if drafts > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        tokens = metric_value(text, "vllm:spec_decode_num_draft_tokens_total", labels)
        accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", labels)
        first = metric_value(
            text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            {"model_name": "cycle", "position": "0"},
        )  # fmt: skip
        assert drafts > 0 and 0 < accepted <= tokens and 0 < first <= accepted
        gen = metric_value(text, "vllm:generation_tokens_total", labels)
        assert gen == 40
    finally:
        server.stop()
