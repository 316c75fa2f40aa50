"""Each sampling parameter moves the distribution the way it should (constructed logits), and
seeded sampling is reproducible alone and batched (through the real engine)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_prompts

from engine.core.request import Request
from engine.sample.sampler import Sampler, apply_penalties
from engine.sampling_params import SamplingParams

VOCAB = 300
DRAWS = 4000


def _req(rid="r", prompt=(1, 2, 3), output=(), eos=None, **params) -> Request:
    params.setdefault("max_tokens", 64)
    req = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos)
    for t in output:
        req.all_token_ids.append(t)
    return req


def _sample(logits: torch.Tensor, requests: list[Request], sampler: Sampler | None = None):
    return (sampler or Sampler(torch.device("cpu")))(logits, requests).sampled_token_ids


def _counts(row: list[float], draws: int = DRAWS, **params) -> torch.Tensor:
    """How often each token is drawn from one logits row, repeated `draws` times in one batch."""
    logits = torch.tensor([row] * draws)
    reqs = [_req(f"r{i}", **params) for i in range(draws)]
    return torch.bincount(torch.tensor(_sample(logits, reqs)), minlength=len(row))


def _log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


@pytest.fixture
def random_logits() -> torch.Tensor:
    return torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [16, V]


def test_temperature_zero_is_argmax(random_logits):
    reqs = [_req(f"r{i}", temperature=0.0) for i in range(16)]
    assert _sample(random_logits, reqs) == random_logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy(random_logits):
    reqs = [_req(f"r{i}", temperature=1.5, top_k=1) for i in range(16)]
    assert _sample(random_logits, reqs) == random_logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy(random_logits):
    reqs = [_req(f"r{i}", temperature=1.5, top_p=1e-6) for i in range(16)]
    assert _sample(random_logits, reqs) == random_logits.argmax(-1).tolist()


def test_temperature_one_matches_softmax():
    probs = [0.5, 0.3, 0.15, 0.05]
    freq = _counts(_log_probs(*probs), temperature=1.0).float() / DRAWS
    assert torch.allclose(freq, torch.tensor(probs), atol=0.035), freq


def test_low_temperature_sharpens():
    freq = _counts(_log_probs(0.5, 0.3, 0.15, 0.05), temperature=0.1).float() / DRAWS
    assert freq[0] > 0.98  # (0.5/0.3)^10 ~ 165:1 against the runner-up


def test_top_k_keeps_only_the_k_best():
    counts = _counts(_log_probs(0.1, 0.4, 0.2, 0.3), temperature=1.0, top_k=2)
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[1] / DRAWS - 4 / 7) < 0.04  # renormalised over the two kept tokens


def test_top_p_cuts_the_tail():
    counts = _counts(_log_probs(0.5, 0.3, 0.15, 0.05), temperature=1.0, top_p=0.7)
    assert counts[2] == 0 and counts[3] == 0  # mass before token 2 is 0.8 >= 0.7
    assert counts[1] > DRAWS * 0.3  # 0.3 / 0.8 of the draws
    assert _counts(_log_probs(0.5, 0.3, 0.15, 0.05), top_p=0.5)[1:].sum() == 0


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # top_k=2 leaves 0.625 / 0.375; top_p=0.6 then keeps only the first.
    counts = _counts(_log_probs(0.5, 0.3, 0.15, 0.05), top_k=2, top_p=0.6)
    assert counts[0] == DRAWS


def test_min_p_drops_unlikely_tokens():
    counts = _counts(_log_probs(0.5, 0.3, 0.15, 0.05), temperature=1.0, min_p=0.2)
    assert counts[3] == 0  # 0.05 < 0.2 * 0.5
    assert counts[2] > DRAWS * 0.1  # 0.15 >= 0.1 stays: 0.15 / 0.95 of the draws


def test_logit_bias_forces_and_bans_a_token(random_logits):
    forced = [_req(f"r{i}", temperature=1.0, logit_bias={7: 100.0}) for i in range(16)]
    assert _sample(random_logits, forced) == [7] * 16
    best = random_logits.argmax(-1).tolist()
    banned = [_req(f"r{i}", temperature=0.0, logit_bias={best[i]: -100.0}) for i in range(16)]
    got = _sample(random_logits, banned)
    assert all(g != b for g, b in zip(got, best))


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # EOS (1) then stop token (2) are the best
    short = _req(eos=1, temperature=0.0, min_tokens=2, stop_token_ids=[2], output=[3])
    assert _sample(logits, [short]) == [3]
    done = _req(eos=1, temperature=0.0, min_tokens=2, stop_token_ids=[2], output=[3, 3])
    assert _sample(logits, [done]) == [1]
    ignoring = _req(eos=1, temperature=0.0, min_tokens=2, ignore_eos=True, output=[3])
    assert _sample(logits, [ignoring]) == [1]  # EOS is no stop token under ignore_eos


def test_repetition_penalty_follows_vllm():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    req = _req(prompt=[0], output=[2], repetition_penalty=1.2, temperature=0.0)
    got = apply_penalties(logits, [req])
    # Seen tokens: positive logits divided, negative ones multiplied; unseen ones untouched.
    assert torch.allclose(got, torch.tensor([[2.0 / 1.2, 1.9, -1.2, 0.5]]))
    assert _sample(logits, [req]) == [1]  # greedy applies the penalty before argmax


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    reqs = [
        _req("a", output=[0, 0, 0], frequency_penalty=0.2, temperature=0.0),  # 2.0 - 0.6
        _req("b", output=[0, 0, 0], frequency_penalty=0.1, temperature=0.0),  # 2.0 - 0.3
        _req("c", output=[0], frequency_penalty=0.2, temperature=0.0),  # 2.0 - 0.2
        _req("d", prompt=[0, 0, 0], frequency_penalty=2.0, temperature=0.0),  # prompt: no effect
    ]
    assert _sample(logits.repeat(4, 1), reqs) == [1, 0, 0, 0]
    assert torch.allclose(apply_penalties(logits, reqs[:1]), torch.tensor([[1.4, 1.5, 0.0]]))


def test_presence_penalty_ignores_count():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    reqs = [
        _req("a", output=[0, 0, 0], presence_penalty=0.6, temperature=0.0),  # 2.0 - 0.6
        _req("b", output=[0, 0, 0], presence_penalty=0.3, temperature=0.0),  # 2.0 - 0.3
        _req("c", output=[1], presence_penalty=-1.0, temperature=0.0),  # negative: encourages
    ]
    assert _sample(logits.repeat(3, 1), reqs) == [1, 0, 1]


def test_penalties_leave_other_rows_alone(random_logits):
    reqs = [_req(f"r{i}", temperature=0.0) for i in range(16)]
    reqs[3] = _req("p", output=[int(random_logits[3].argmax())], presence_penalty=2.0,
                   temperature=0.0, repetition_penalty=2.0)  # fmt: skip
    got = _sample(random_logits, reqs)
    expected = random_logits.argmax(-1).tolist()
    assert got[:3] + got[4:] == expected[:3] + expected[4:]
    assert got[3] != expected[3]


def test_seeded_rows_do_not_depend_on_the_batch(random_logits):
    def run(batch_extra: int, rounds: int = 5) -> list[int]:
        sampler, tokens = Sampler(torch.device("cpu")), []
        for _ in range(rounds):
            reqs = [_req("seeded", temperature=1.0, seed=1234)]
            reqs += [_req(f"x{i}", temperature=1.0, seed=i if i % 2 else None)
                     for i in range(batch_extra)]  # fmt: skip
            logits = torch.cat([random_logits[:1], random_logits[1 : 1 + batch_extra]])
            tokens.append(_sample(logits, reqs, sampler)[0])
        return tokens

    alone = run(0)
    assert run(7) == alone == run(15)
    assert len(set(alone)) > 1  # really sampled, not a greedy stand-in


def test_greedy_rows_stay_exact_in_a_mixed_batch(random_logits):
    reqs = [_req(f"r{i}", temperature=0.0 if i % 2 else 2.0) for i in range(16)]
    got = _sample(random_logits, reqs)
    expected = random_logits.argmax(-1).tolist()
    assert all(got[i] == expected[i] for i in range(1, 16, 2))


# ---- through the real engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32")


def _seeded(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, **kw)


def test_engine_seeded_sampling_alone_equals_batched(llm):
    prompt = make_prompts(1, seed=5)[0]
    others = make_prompts(6, seed=6)
    alone = llm.generate([prompt], _seeded(42), use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompt], _seeded(42), use_tqdm=False)[0].outputs[0].token_ids
    params = [_seeded(7), _seeded(None), _seeded(42), _seeded(None, top_p=0.8), _seeded(3)]
    params += [_seeded(None), _seeded(11, top_k=20)]
    prompts = others[:2] + [prompt] + others[2:]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert alone == again == batched[2].outputs[0].token_ids
    other_seed = llm.generate([prompt], _seeded(43), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_engine_penalties_and_bias_change_greedy_output(llm):
    prompt = make_prompts(1, seed=8)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the tiny model repeats itself, so penalties bite
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)
        got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
        assert got != base and len(set(got)) > len(set(base)), kw
    biased = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={42: 100})
    assert llm.generate([prompt], biased, use_tqdm=False)[0].outputs[0].token_ids == [42] * 4


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zeros():
    from engine.sample.sampler import sample_inverse_cdf

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    drawn = sample_inverse_cdf(probs, torch.rand(20000, 1, generator=gen))
    freq = torch.bincount(drawn, minlength=6).float() / 20000
    assert freq[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
    # the ends of [0, 1): u = 0 takes the first possible token, u -> 1 the last possible one
    edges = sample_inverse_cdf(probs[:2], torch.tensor([[0.0], [1.0 - 2**-24]]))
    assert edges.tolist() == [1, 4]


@pytest.mark.parametrize("k", [None, 5, 300, 2000])
def test_top_p_candidates_path_equals_full_sort(k):
    from engine.sample.sampler import _top_k_top_p_sorted, apply_top_k_top_p

    gen = torch.Generator().manual_seed(3)
    vocab = 4096
    # peaked rows end their nucleus among the best 256; flat rows need the full sort
    logits = torch.cat([torch.randn(6, vocab, generator=gen) * 6, torch.randn(6, vocab) * 0.1])
    top_ps = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.3, 0.95] * 2)
    ks = None if k is None else torch.full((12,), k)
    got = apply_top_k_top_p(logits, ks, top_ps)
    want = _top_k_top_p_sorted(logits, ks, top_ps)
    assert torch.equal(got.isinf(), want.isinf())  # the same tokens survive
    kept = ~want.isinf()
    assert torch.equal(got[kept], logits[kept])
    if k is None:
        assert kept[6:].sum(dim=-1).min() > 256  # the flat rows did take the sorted path
