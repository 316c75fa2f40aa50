"""Constrained decoding through the engine: preemption, seeds, n, EOS, length, logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["word", "n", "ok"],
    "additionalProperties": False,
}
PROMPTS = [[3 + (7 * i + j) % 250 for j in range(20 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32")


def generate(llm, prompts, **kw):
    kw.setdefault("structured_outputs", GrammarSpec.json_schema(SCHEMA))
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 120), **kw)
    return llm.generate([list(p) for p in prompts], params, use_tqdm=False)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_outputs_follow_the_schema_greedy_and_random(llm):
    import jsonschema

    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        for out in generate(llm, PROMPTS, **kw):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.token_ids[-1] == llm.get_tokenizer().eos_token_id  # EOS once accepted


def test_preemption_by_recompute_keeps_the_matcher(llm, tiny_model_dir):
    """A pool too small for the batch preempts; the outputs equal those of a roomy pool."""
    small = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=24, block_size=8)
    tight = generate(small, PROMPTS, temperature=1.0, seed=11)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    assert texts(tight) == texts(generate(llm, PROMPTS, temperature=1.0, seed=11))


def test_seeded_outputs_do_not_depend_on_the_batch(llm):
    alone = [texts(generate(llm, [p], temperature=1.0, seed=5))[0] for p in PROMPTS[:2]]
    mixed = [[3, 4, 5]] * 2  # unconstrained neighbours in the same steps
    together = llm.generate(
        [list(p) for p in PROMPTS[:2] + mixed],
        [
            SamplingParams(
                max_tokens=120,
                temperature=1.0,
                seed=5,
                structured_outputs=GrammarSpec.json_schema(SCHEMA),
            )
        ]
        * 2
        + [SamplingParams(max_tokens=20, temperature=0.0)] * 2,
        use_tqdm=False,
    )
    assert texts(together[:2]) == alone
    free = generate(llm, mixed[:1], temperature=0.0, max_tokens=20, structured_outputs=None)
    assert texts(together[2:]) == texts(free) * 2


def test_eos_is_held_back_until_the_grammar_accepts(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = generate(
        llm,
        PROMPTS[:2],
        temperature=0.0,
        logit_bias={eos: 100.0},
        structured_outputs=GrammarSpec.choice(["abc", "xyz!"]),
    )
    assert set(texts(out)) <= {"abc", "xyz!"}
    assert all(o.outputs[0].finish_reason == "stop" for o in out)


def test_max_tokens_inside_the_grammar_is_length(llm):
    out = generate(llm, PROMPTS[:1], temperature=0.0, max_tokens=4)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"')


def test_logprobs_are_of_the_raw_distribution(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    out = generate(
        llm,
        [prompt],
        temperature=0.0,
        logprobs=0,
        structured_outputs=GrammarSpec("regex", "[0-9]{6}"),
    )[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        raw = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # [T, vocab]
    expect = raw.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert torch.allclose(got, expect, atol=1e-4)
    assert bool((expect < raw.max(-1).values - 1e-3).any())  # the grammar overrode argmax
