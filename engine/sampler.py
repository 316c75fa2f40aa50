"""Batched sampling from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """A seeded request owns its generator, so its draws do not depend on the batch."""
        if params.seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed % 2**64)
            self.generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, vocab] float32
        requests: list[Request],  # one per row
    ) -> list[int]:
        params = [r.sampling_params for r in requests]
        request_ids = [r.request_id for r in requests]
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = self._probs(logits[random_rows], [params[i] for i in random_rows])
        sampled = greedy.clone()
        for row, i in enumerate(random_rows):
            gen = self.generator_for(request_ids[i], params[i])
            sampled[i] = torch.multinomial(probs[row], 1, generator=gen)[0]
        return sampled.tolist()

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            logits = _apply_top_k(logits, top_ks)
        top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
        if (top_ps < 1.0).any():
            logits = _apply_top_p(logits, top_ps)
        return torch.softmax(logits, dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (ks - 1)[:, None])  # [N, 1] smallest kept value
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p; the top token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
