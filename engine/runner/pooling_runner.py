"""The pooling runner: one forward over a batch of whole prompts, then one vector per prompt.

No sampling, no decode, no KV cache kept between steps. Encoders (BERT) run a padded batch
through torch SDPA with a key mask; decoders (Qwen3-Embedding shape: the generating families'
classes) run the flattened batch over a scratch paged KV cache sized to the batch, through the
same attention backend and layers as generation. Pooling and normalisation follow the
checkpoint (engine/runner/pooling_config.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import EngineConfig
from engine.dtype import resolve_dtype
from engine.layers import select_impls
from engine.model_loader.weight_loader import read_weights
from engine.models import MODEL_REGISTRY, check_model_config, get_model_class
from engine.models.bert import BertForSequenceClassification, BertModel
from engine.runner.model_runner import resolve_device
from engine.runner.pooling_config import PoolingConfig, is_cross_encoder, is_encoder
from pagedserve_kernels import AttentionMetadata, get_attention_backend
from pagedserve_kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger(__name__)


class PoolingRunner:
    def __init__(
        self, config: EngineConfig, model_dir: Path, hf_config, pooling: PoolingConfig
    ) -> None:
        self.config, self.pooling = config, pooling
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.block_size = config.block_size
        self.encoder = is_encoder(hf_config)
        self.cross_encoder = is_cross_encoder(hf_config)
        # vLLM's classifier_from_token (Qwen3-Reranker): the LM head's rows of these tokens,
        # ("no", "yes"), score a pair by sigmoid(logit_yes - logit_no) at its last token
        self.classifier_token_ids: tuple[int, int] | None = None
        torch.manual_seed(config.seed)
        if self.encoder:
            self.backend_name = "torch sdpa (bidirectional)"
            cls = BertForSequenceClassification if is_cross_encoder(hf_config) else BertModel
            model: nn.Module = cls(hf_config)
        else:
            hf_config.architectures = [decoder_architecture(hf_config)]
            check_model_config(hf_config, config.max_model_len)
            backend = get_attention_backend(
                config.attention_backend, self.device.type, config.block_size, self.dtype
            )
            self.backend_name = backend.name
            model = get_model_class(hf_config)(hf_config, backend)
        _load(model, model_dir, decoder=not self.encoder, needs_head=self.cross_encoder)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if not self.encoder:
            select_impls(self.model, load_cpu_ops() if self.device.type == "cpu" else None)
        self.hidden_size = hf_config.hidden_size
        logger.info(
            "pooling runner: %s pooling, normalize=%s (%s)",
            pooling.pooling_type,
            pooling.normalize,
            pooling.source,
        )

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """One float32 CPU vector per prompt, pooled and not yet normalised."""
        if self.encoder:
            hidden, lengths = self._run_encoder(prompts)
            rows = [hidden[i, :n] for i, n in enumerate(lengths)]
        else:
            flat = self._run_decoder(prompts)
            rows = list(torch.split(flat, [len(p) for p in prompts]))
        return [pool_rows(r, self.pooling.pooling_type).float().cpu() for r in rows]

    @torch.inference_mode()
    def score(self, prompts: list[list[int]], token_types: list[list[int]]) -> list[float]:
        """A cross-encoder's relevance per (pair) prompt: sigmoid of its one logit, as
        sentence-transformers' CrossEncoder scores."""
        if not self.encoder:
            return self._score_decoder(prompts)
        hidden, _ = self._run_encoder(prompts, token_types)
        logits = self.model.classify(hidden[:, 0]).float()
        return torch.sigmoid(logits[:, 0]).cpu().tolist()

    def _score_decoder(self, prompts: list[list[int]]) -> list[float]:
        if self.classifier_token_ids is None:
            raise ValueError("a decoder reranker needs classifier_from_token (--hf-overrides)")
        flat = self._run_decoder(prompts)
        ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
        logits = self.model.compute_logits(flat[ends.to(flat.device)])  # [B, vocab] float32
        no, yes = self.classifier_token_ids
        return torch.sigmoid(logits[:, yes] - logits[:, no]).cpu().tolist()

    def _run_encoder(self, prompts, token_types=None) -> tuple[torch.Tensor, list[int]]:
        lengths = [len(p) for p in prompts]
        ids = torch.zeros((len(prompts), max(lengths)), dtype=torch.long)
        types = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            if token_types is not None:
                types[i, : len(p)] = torch.tensor(token_types[i])
        lens = torch.tensor(lengths, device=self.device)
        dev = self.device
        return self.model(ids.to(dev), lens, types.to(dev)), lengths

    def _run_decoder(self, prompts: list[list[int]]) -> torch.Tensor:
        """The flattened batch over a scratch KV cache: each prompt's blocks are contiguous."""
        bs, dev = self.block_size, self.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        nblocks = (lengths + bs - 1) // bs
        first_block = torch.cumsum(nblocks, 0) - nblocks
        max_blocks = int(nblocks.max())
        table = first_block[:, None] + torch.arange(max_blocks)[None]  # [B, max_blocks]
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        starts = torch.repeat_interleave(first_block * bs, lengths)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
        meta = AttentionMetadata(
            slot_mapping=(starts + positions).to(dev),
            query_start_loc=cu.to(torch.int32).to(dev),
            seq_lens=lengths.to(torch.int32).to(dev),
            block_table=table.to(torch.int32).to(dev),
            query_lens_cpu=lengths.tolist(),
            seq_lens_cpu=lengths.tolist(),
            max_query_len=int(lengths.max()),
            max_seq_len=int(lengths.max()),
        )
        attn = self.model.model.layers[0].self_attn
        shape = (int(nblocks.sum()), bs, attn.num_kv_heads, attn.head_dim)
        kw = dict(dtype=self.dtype, device=dev)
        caches = [
            (torch.empty(shape, **kw), torch.empty(shape, **kw)) for _ in self.model.model.layers
        ]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        return self.model(ids, positions.to(dev), meta, caches)


def decoder_architecture(hf_config) -> str:
    """A bare decoder backbone (Qwen3Model, as sentence-transformers saves Qwen3-Embedding)
    runs as its generating class (Qwen3ForCausalLM), whose LM head pooling never uses."""
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    for suffix in ("Model", "ForSequenceClassification"):
        causal = arch.removesuffix(suffix) + "ForCausalLM"
        if arch.endswith(suffix) and causal in MODEL_REGISTRY:
            return causal
    return arch


def pool_rows(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """[n, hidden] -> [hidden] by the model's pooling."""
    if pooling_type == "CLS":
        return rows[0]
    if pooling_type == "LAST":
        return rows[-1]
    if pooling_type == "MAX":
        return rows.max(dim=0).values
    return rows.float().mean(dim=0)


def finish_embedding(vec: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation first, then the model's normalisation (as sentence-transformers)."""
    if dimensions is not None:
        vec = vec[:dimensions]
    return F.normalize(vec, p=2, dim=-1) if normalize else vec


def _load(model: nn.Module, model_dir: Path, decoder: bool, needs_head: bool = False) -> None:
    """The checkpoint's tensors into the model; ValueError naming what does not fit. A decoder
    embedder saved as a bare backbone (Qwen3Model: no `model.` prefix, no lm_head) loads too."""
    state, _ = read_weights(model_dir)
    if decoder and not any(k.startswith("model.") for k in state):
        state = {f"model.{k}": v for k, v in state.items()}
    missing, unexpected = model.load_weights(state)
    if decoder and not needs_head:  # the LM head is not used for embeddings
        missing = [m for m in missing if not m.startswith("lm_head.")]
        unexpected = [u for u in unexpected if not u.startswith(("lm_head.", "score."))]
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights do not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
