"""The runner side of pooling on the shared scheduler (vLLM V1's pooling model runner).

PoolingModelRunner is the generating ModelRunner (paged KV cache, chunked prefill, prefix
cache, the same attention backend and layers) whose step ends in pooling instead of logits:
each scheduled chunk's hidden states feed its request's pooling, and a request whose chunk
reached its last prompt token hands back its vector (ModelRunnerOutput.pooler_output); the
scheduler then finishes it (engine/core/pooling.py). Across chunks, LAST needs nothing kept,
MEAN a running float32 sum, MAX a running max and CLS the first chunk's first row; a chunk that
starts at position 0 (a first admission or a resume after preemption) starts them afresh.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.layers import select_impls
from engine.models import get_model_class
from engine.outputs import ModelRunnerOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.pooling_runner import _load, decoder_architecture
from pagedserve_kernels.cpu_ops import load_cpu_ops


class PoolingModelRunner(ModelRunner):
    def __init__(self, config, model_dir: Path, hf_config) -> None:
        if config.quantization:
            raise ValueError("the pooling runner serves float weights: drop --quantization")
        # a bare backbone (Qwen3Model) runs as its generating class, whose LM head goes unused
        hf_config.architectures = [decoder_architecture(hf_config)]
        super().__init__(config, model_dir, hf_config)
        self.decode_graphs = self.fused_decode = None  # pooling steps are prefills
        self.pooler = Pooler()

    def _load_model(self, model_dir: Path, hf_config) -> nn.Module:
        """The generating class with an embedder's weights (bare backbone or not, no head)."""
        model = get_model_class(hf_config)(hf_config, self.backend)
        _load(model, model_dir, decoder=True)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        select_impls(model, load_cpu_ops() if self.device.type == "cpu" else None)
        return model

    @torch.inference_mode()
    def execute(self, out) -> ModelRunnerOutput:
        """The step's forward over the paged KV cache, then pooling; nothing is sampled."""
        for request_id in out.finished_req_ids:
            self.release(request_id)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids=[])
        input_ids, positions, meta, _, _ = self.prepare_inputs(out)
        hidden = self._forward(out, input_ids, positions, meta)
        return ModelRunnerOutput(
            sampled_token_ids=[None] * len(out.requests),
            pooler_output=self.pooler.pool(out, hidden),
        )

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.pooler.release(request_id)


class Pooler:
    """Per-request pooling state across a prompt's chunks."""

    def __init__(self) -> None:
        self.partial: dict[str, torch.Tensor] = {}  # MEAN: sum, MAX: max, CLS: first row

    def pool(self, out, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """request id -> pooled float32 CPU vector, for the requests whose prompt is done."""
        pooled: dict[str, torch.Tensor] = {}
        row = 0
        for req, n, start in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens):
            rows, row = hidden[row : row + n], row + n
            kind = req.pooling_params.pooling_type
            done = start + n == req.num_tokens
            if kind == "LAST":
                if done:
                    pooled[req.request_id] = rows[-1].float().cpu()
                continue
            self._accumulate(req.request_id, kind, rows, fresh=start == 0)
            if done:
                vec = self.partial.pop(req.request_id)
                pooled[req.request_id] = (vec / req.num_tokens if kind == "MEAN" else vec).cpu()
        return pooled

    def _accumulate(self, rid: str, kind: str, rows: torch.Tensor, fresh: bool) -> None:
        prev = None if fresh else self.partial.get(rid)
        if kind == "CLS":
            self.partial[rid] = rows[0].float() if prev is None else prev
        elif kind == "MEAN":
            total = rows.float().sum(dim=0)
            self.partial[rid] = total if prev is None else prev + total
        else:  # MAX
            peak = rows.float().max(dim=0).values
            self.partial[rid] = peak if prev is None else torch.maximum(prev, peak)

    def release(self, request_id: str) -> None:
        self.partial.pop(request_id, None)
