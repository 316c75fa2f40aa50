"""Batch bitmasks: filled by the matchers, applied as tensors, raw logits left alone."""

from __future__ import annotations

import torch

from engine.sample.grammar_mask import GrammarBitmask, accept_tokens
from engine.sampling_params import GrammarSpec


def unpack_slowly(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # [R, vocab] bool allowed
    return torch.tensor(
        [[bool((int(row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for row in bitmask]
    )


def test_apply_matches_bit_by_bit_reference():
    vocab = 100  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    raw = logits.clone()
    masks = GrammarBitmask(vocab, torch.device("cpu"))
    out = masks.apply(logits, [0, 2, 4], bitmask, raw=logits)
    assert torch.equal(logits, raw)  # the raw tensor was copied, not written
    allowed = unpack_slowly(bitmask, vocab)
    for r, row in enumerate([0, 2, 4]):
        expect = torch.where(allowed[r], raw[row], float("-inf"))
        assert torch.equal(out[row], expect)
    assert torch.equal(out[[1, 3]], raw[[1, 3]])  # unconstrained rows untouched


def test_fill_gives_each_row_its_own_mask(tokenizer, compiler):
    digits = compiler.compile(GrammarSpec("regex", "[0-9]+")).new_matcher()
    yes_no = compiler.compile(GrammarSpec.choice(["yes", "no"])).new_matcher()
    masks = GrammarBitmask(len(tokenizer), torch.device("cpu"))
    allowed = unpack_slowly(masks.fill([digits, yes_no]), len(tokenizer))
    as_ids = lambda chars: sorted(tokenizer.convert_tokens_to_ids(list(chars)))
    assert allowed[0].nonzero().flatten().tolist() == as_ids("0123456789")
    assert allowed[1].nonzero().flatten().tolist() == as_ids("yn")


def test_eos_only_where_the_grammar_accepts(tokenizer, compiler):
    m = compiler.compile(GrammarSpec.choice(["ab"])).new_matcher()
    masks = GrammarBitmask(len(tokenizer), torch.device("cpu"))
    eos = tokenizer.eos_token_id
    accept_tokens([m], tokenizer.encode("a"))
    assert not unpack_slowly(masks.fill([m]), len(tokenizer))[0, eos]
    accept_tokens([m], tokenizer.encode("b"))
    allowed = unpack_slowly(masks.fill([m]), len(tokenizer))[0]
    assert allowed.nonzero().flatten().tolist() == [eos]  # finished: only EOS remains


def test_masked_greedy_and_random_rows_sample_allowed_tokens(tokenizer, compiler):
    from engine.sample.sampler import sample_inverse_cdf

    vocab = len(tokenizer)
    matchers = [compiler.compile(GrammarSpec("regex", "[a-z]")).new_matcher() for _ in range(8)]
    masks = GrammarBitmask(vocab, torch.device("cpu"))
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1))
    out = masks.apply(logits, list(range(8)), masks.fill(matchers), raw=logits)
    lower = set(tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))
    assert set(out.argmax(-1).tolist()) <= lower
    drawn = sample_inverse_cdf(out.softmax(-1), torch.rand(8, 1))
    assert set(drawn.tolist()) <= lower
