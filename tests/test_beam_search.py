"""Beam search on copy-on-write forks (engine/core/beam_search.py): every sequence and its order
equal transformers' generate(num_beams=k, num_return_sequences=k, do_sample=False) in float32
for length_penalty / early_stopping / EOS / stop tokens / max_tokens, alone and beside other
requests, under chunked prefill, prefix hits and preemption; every block is freed after; the
official openai client gets the n sequences through a real server (extra_body)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model_dir, make_prompts, serve_float32

from engine import LLM, SamplingParams
from engine.sampling_params import SamplingParamsError

BS = 4
EOS = 130  # a token the tiny model often picks, so hypotheses end early and early stopping acts


@pytest.fixture(scope="module")
def beam_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-beam"), eos_token_id=EOS)


@pytest.fixture(scope="module")
def hf_model(beam_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(beam_model_dir, dtype=torch.float32).eval()


def hf_beams(model, ids, k, max_new, eos_ids=None, length_penalty=1.0, early_stopping=False, **kw):
    """transformers' beam search: the k sequences' new tokens, best first (EOS kept, the fill
    after it dropped)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos_ids,
            pad_token_id=0,
            **kw,
        )
    rows = []
    for row in out[:, len(ids) :].tolist():
        row = [t for t in row if t != -1]  # the fill without an EOS (with one: the EOS)
        end = next((i + 1 for i, t in enumerate(row) if eos_ids and t in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 8)  # chunked prefill: prompts run in several chunks
    return LLM(str(path), dtype="float32", block_size=BS, max_model_len=256, **kw)


def _eos_ids(llm: LLM) -> list[int]:
    e = llm.engine
    return sorted({e.eos_token_id, *e.eos_token_ids} - {None})


def _assert_all_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert not kv.req_to_blocks and not kv.cow_requests and not kv.fork_members
    assert not sched.requests and not sched.running and not sched.waiting
    assert not llm.engine.beams.groups and not llm.engine.beams.owner


CASES = [  # width, max_tokens, length_penalty, early_stopping, ignore_eos
    (4, 12, 1.0, False, True),
    (3, 30, 1.0, False, False),
    (4, 30, 0.5, True, False),
    (2, 24, 2.0, "never", False),
    (4, 24, -1.0, False, False),
    (5, 20, 1.0, "never", False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"k{c[0]}-lp{c[2]}-es{c[3]}" for c in CASES])
def test_equals_transformers_alone(beam_model_dir, hf_model, case):
    width, max_new, lp, es, ignore_eos = case
    prompts = make_prompts(2, seed=45, min_len=9, max_len=30)
    llm = _llm(beam_model_dir)
    eos = None if ignore_eos else _eos_ids(llm)
    params = SamplingParams(
        n=width, use_beam_search=True, max_tokens=max_new, length_penalty=lp,
        early_stopping=es, ignore_eos=ignore_eos,
    )  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_beams(hf_model, prompt, width, max_new, eos, lp, es)
        assert [c.token_ids for c in out.outputs] == expected
        assert [c.index for c in out.outputs] == list(range(width))
        for c in out.outputs:
            ended = c.token_ids[-1] in (eos or ()) and len(c.token_ids) <= max_new
            assert c.finish_reason == ("stop" if ended else "length")
    _assert_all_free(llm)
    assert llm.engine.scheduler.num_forks_total > 0


def test_some_hypotheses_end_on_eos(beam_model_dir, hf_model):
    """The cases above exercise finished hypotheses: EOS does end some beams early."""
    prompts = make_prompts(2, seed=45, min_len=9, max_len=30)
    llm = _llm(beam_model_dir)
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=30)
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths = [len(c.token_ids) for o in outs for c in o.outputs]
    assert min(lengths) < 30 and any(c.finish_reason == "stop" for o in outs for c in o.outputs)


def test_beside_other_requests_with_prefix_hits_and_preemption(beam_model_dir, hf_model):
    """Beam groups share steps with greedy requests and n=2 samples; the second round hits the
    prefix cache; a small pool preempts; everything still equals transformers."""
    from conftest import hf_greedy

    prompts = make_prompts(3, seed=46, min_len=12, max_len=28)
    llm = _llm(beam_model_dir, num_gpu_blocks_override=40, max_num_batched_tokens=16)
    eos = _eos_ids(llm)
    beam = SamplingParams(n=3, use_beam_search=True, max_tokens=20, length_penalty=0.7)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True)
    expected_beams = [hf_beams(hf_model, p, 3, 20, eos, 0.7) for p in prompts]
    expected_greedy = hf_greedy(beam_model_dir, prompts, 20)
    for _ in range(2):  # the second round: prompts in the prefix cache
        outs = llm.generate(prompts * 2, [beam] * 3 + [greedy] * 3, use_tqdm=False)
        for i in range(3):
            assert [c.token_ids for c in outs[i].outputs] == expected_beams[i]
            assert [c.token_ids for c in outs[3 + i].outputs] == [expected_greedy[i]] * 2
        _assert_all_free(llm)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert max(o.num_cached_tokens for o in outs[:3]) > 0


def test_stop_token_ids_and_stop_strings(beam_model_dir, hf_model):
    """A stop token id ends a hypothesis as EOS would (transformers given it as the EOS); a stop
    string cuts the text and ends the hypothesis that completes it."""
    (prompt,) = make_prompts(1, seed=45, min_len=9, max_len=30)
    llm = _llm(beam_model_dir)
    params = SamplingParams(
        n=3, use_beam_search=True, max_tokens=20, ignore_eos=True, stop_token_ids=[EOS]
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == hf_beams(hf_model, prompt, 3, 20, [EOS])
    assert any(c.stop_reason == EOS for c in out.outputs)
    plain = SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True)
    (base,) = llm.generate([prompt], plain, use_tqdm=False)
    stop = "="  # the third token of every beam above
    assert all(c.text.index(stop) < 4 for c in base.outputs)
    # length_penalty < 0 favours short hypotheses: the stopped ones win
    with_stop = SamplingParams(**{**plain.__dict__, "stop": [stop], "length_penalty": -1.0})
    (cut,) = llm.generate([prompt], with_stop, use_tqdm=False)
    # transformers' stop_strings end a candidate as ours do (one byte per token here)
    tok = llm.engine.tokenizer
    expected = hf_beams(hf_model, prompt, 3, 12, None, -1.0, stop_strings=[stop], tokenizer=tok)
    assert [c.token_ids for c in cut.outputs] == expected
    assert any(c.stop_reason == stop for c in cut.outputs)
    assert all(stop not in c.text for c in cut.outputs)
    _assert_all_free(llm)


def test_abort_frees_every_beam(beam_model_dir):
    (prompt,) = make_prompts(1, seed=48, min_len=10, max_len=20)
    llm = _llm(beam_model_dir)
    engine = llm.engine
    engine.add_request("b", prompt, SamplingParams(n=4, use_beam_search=True, max_tokens=50))
    for _ in range(12):
        engine.step()
    assert len(engine.scheduler.running) > 1  # forked beams
    (out,) = engine.abort_request(["b"])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.step()
    _assert_all_free(llm)


def test_refusals_name_the_field():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(n=2, use_beam_search=True, early_stopping="sometimes")
    assert e.value.param == "early_stopping"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(n=2, use_beam_search=True, logprobs=2)
    assert e.value.param == "logprobs"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(n=2, use_beam_search=True, length_penalty=float("nan"))
    assert e.value.param == "length_penalty"


@pytest.fixture(scope="module")
def beam_server(beam_model_dir):
    yield from serve_float32(beam_model_dir, "tiny-beam", "--block-size", str(BS))


def test_openai_client_completions_and_chat(beam_server, beam_model_dir, hf_model):
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=beam_server.url + "/v1", api_key="x")
    (prompt,) = make_prompts(1, seed=49, min_len=10, max_len=20)
    extra = {"use_beam_search": True, "length_penalty": 0.8, "early_stopping": True}
    resp = client.completions.create(
        model="tiny-beam", prompt=prompt, n=3, max_tokens=16, temperature=0, extra_body=extra
    )
    llm_eos = [EOS, AutoTokenizer.from_pretrained(beam_model_dir).eos_token_id]
    expected = hf_beams(hf_model, prompt, 3, 16, sorted(set(llm_eos)), 0.8, True)
    tok = AutoTokenizer.from_pretrained(beam_model_dir)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [
        tok.decode(e, skip_special_tokens=True) for e in expected
    ]
    assert resp.usage.completion_tokens == sum(len(e) for e in expected)
    stream = client.completions.create(
        model="tiny-beam", prompt=prompt, n=3, max_tokens=16, stream=True, extra_body=extra
    )
    texts, reasons = ["", "", ""], [None] * 3
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in resp.choices]
    assert reasons == [c.finish_reason for c in resp.choices]
    chat = client.chat.completions.create(
        model="tiny-beam",
        messages=[{"role": "user", "content": "hi there"}],
        n=2,
        max_tokens=8,
        extra_body={"use_beam_search": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    assert chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(Exception) as e:
        client.completions.create(
            model="tiny-beam", prompt="x", n=2, extra_body={**extra, "early_stopping": "sometimes"}
        )
    assert e.value.status_code == 400 and "early_stopping" in str(e.value)


def test_forks_stay_within_max_num_seqs(beam_model_dir, hf_model):
    """A beam group is admitted only when its whole width fits under max_num_seqs (its first
    beam holds the seats its forks take), so running never exceeds it; a width past it is
    refused naming n."""
    from engine.core.request import RequestRejectedError

    prompts = make_prompts(3, seed=47, min_len=6, max_len=8)
    prompts[2] = make_prompts(1, seed=48, min_len=40, max_len=40)[0]
    llm = _llm(beam_model_dir, max_num_seqs=5, max_num_batched_tokens=16)
    sched = llm.engine.scheduler
    peak, schedule = [0], sched.schedule

    def counting_schedule():
        out = schedule()
        peak[0] = max(peak[0], len(sched.running))
        return out

    sched.schedule = counting_schedule
    eos = _eos_ids(llm)
    beam = SamplingParams(n=3, use_beam_search=True, max_tokens=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    pair = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)  # forks too
    # the pair's first token comes while the long beam prompt is still in prefill chunks: its
    # fork must leave the beam group's reserved seats alone
    outs = llm.generate(prompts, [pair, greedy, beam], use_tqdm=False)
    assert [c.token_ids for c in outs[2].outputs] == hf_beams(hf_model, prompts[2], 3, 8, eos)
    outs = llm.generate(prompts, [beam] * 3, use_tqdm=False)
    for i, p in enumerate(prompts):
        assert [c.token_ids for c in outs[i].outputs] == hf_beams(hf_model, p, 3, 8, eos)
    sched.schedule = schedule
    assert peak[0] == 5  # full, never past it (without the reservation: 9)
    _assert_all_free(llm)
    with pytest.raises(RequestRejectedError) as e:
        llm.engine.add_request("wide", prompts[0], SamplingParams(n=6, use_beam_search=True))
    assert e.value.param == "n"
