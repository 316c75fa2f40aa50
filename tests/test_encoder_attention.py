"""The attention backends' non-causal (encoder) seam, AttentionBackend.encoder_attention.

Every backend that runs on CPU (the SDPA default, the torch reference, the C++ kernels' backend
and the flash-attn backend over tests/fake_flash_attn.py) against one plain SDPA call over all
tokens with a block-diagonal mask, for segments of several lengths, in float32 and bf16; the
padded-batch mask BERT passes; and the towers and BERT calling through the backend they were
given.
"""

from __future__ import annotations

import sys

import fake_flash_attn
import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels.backend import AttentionBackend
from pagedserve_kernels.cpu_ops import load_cpu_ops
from pagedserve_kernels.encoder_attention import equal_runs
from pagedserve_kernels.reference import TorchAttentionBackend

SEGMENTS = [[7], [5, 5, 5], [3, 9, 9, 1, 16], [16, 16, 4, 4, 4, 30]]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _flash(monkeypatch):
    from pagedserve_kernels.flash_attn import FlashAttentionBackend

    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    fake_flash_attn.calls.clear()
    return FlashAttentionBackend(fake_flash_attn, 2)


def _cpu():
    from pagedserve_kernels.cpu_backend import CpuAttentionBackend

    ops = load_cpu_ops()
    assert ops is not None, "the C++ kernels must build here (see test_cpu_ops.py)"
    return CpuAttentionBackend(ops)


BACKENDS = {
    "default": lambda mp: AttentionBackend(),
    "torch": lambda mp: TorchAttentionBackend(),
    "cpu": lambda mp: _cpu(),
    "flash_attn": _flash,
}


def block_diagonal_reference(q, k, v, seq_lens, scale):
    """One SDPA over every token, each query seeing only its own segment's keys."""
    seg = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    mask = seg[:, None] == seg[None, :]
    out = F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)


def _qkv(total: int, dtype, heads: int = 4, head_dim: int = 32):
    g = torch.Generator().manual_seed(total)
    return [torch.randn(total, heads, head_dim, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_encoder_attention_equals_block_diagonal_sdpa(name, dtype, monkeypatch):
    backend = BACKENDS[name](monkeypatch)
    for seq_lens in SEGMENTS:
        q, k, v = _qkv(sum(seq_lens), dtype)
        scale = 0.3 if len(seq_lens) % 2 else None  # an explicit scale and the default
        out = backend.encoder_attention(q, k, v, seq_lens, scale)
        assert out.shape == q.shape and out.dtype == dtype
        ref = block_diagonal_reference(q, k, v, seq_lens, scale)
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    if name == "flash_attn":  # bf16 takes flash-attn's varlen, float32 stays on SDPA
        assert fake_flash_attn.calls == (
            ["flash_attn_varlen_func"] * len(SEGMENTS) if dtype == torch.bfloat16 else []
        )


@pytest.mark.parametrize("name", list(BACKENDS))
def test_encoder_attention_with_a_padding_mask(name, monkeypatch):
    """BERT's padded batch: [B, 1, 1, L] keys to keep; rows past a length read only real keys."""
    backend = BACKENDS[name](monkeypatch)
    b, length, lengths = 3, 6, [6, 2, 4]
    q, k, v = _qkv(b * length, torch.bfloat16)
    keep = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    out = backend.encoder_attention(q, k, v, [length] * b, mask=keep[:, None, None, :])
    for i, n in enumerate(lengths):
        rows = slice(i * length, (i + 1) * length)
        keys = slice(i * length, i * length + n)
        ref = F.scaled_dot_product_attention(
            *(t.float().transpose(0, 1) for t in (q[rows], k[keys], v[keys]))
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), ref, atol=2e-2, rtol=2e-2)


def test_mixed_lengths_with_a_mask_is_refused():
    q, k, v = _qkv(5, torch.float32)
    mask = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="one length"):
        AttentionBackend().encoder_attention(q, k, v, [2, 3], mask=mask)
    with pytest.raises(ValueError, match="segments of 4 tokens for 5"):
        AttentionBackend().encoder_attention(q, k, v, [2, 2])


def test_equal_runs():
    assert equal_runs([4, 4, 2, 4, 4, 4]) == [(4, 2), (2, 1), (4, 3)]


class SpyBackend(AttentionBackend):
    def __init__(self) -> None:
        self.seq_lens: list[list[int]] = []

    def encoder_attention(self, query, key, value, seq_lens, scale=None, mask=None):
        self.seq_lens.append(list(seq_lens))
        return super().encoder_attention(query, key, value, seq_lens, scale, mask)


def test_towers_and_bert_attend_through_their_backend():
    from transformers import BertConfig, CLIPVisionConfig

    from engine.models.bert import BertModel
    from engine.models.vision_tower import VisionTower

    spy = SpyBackend()
    cfg = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8,
    )
    VisionTower(cfg, spy).hidden_states(torch.randn(3, 3, 32, 32), [-1])
    assert spy.seq_lens == [[17] * 3] * 2  # 16 patches + the class token, per layer
    spy.seq_lens.clear()
    bcfg = BertConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16,
    )
    BertModel(bcfg, spy)(torch.randint(0, 50, (2, 5)), torch.tensor([5, 3]))
    assert spy.seq_lens == [[5, 5]] * 2
