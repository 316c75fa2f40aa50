"""BERT-family bidirectional encoder (all-MiniLM-L6-v2 and its kin) for the pooling runner.

Runs a padded batch [B, L] with a key mask through the attention backend's encoder_attention
(SDPA by default; no KV cache: an encoder reads
each input once). Module names follow Hugging Face's BertModel (embeddings.*, encoder.layer[i]
.attention.self.query / .attention.output.dense / .intermediate.dense / .output.dense) so its
checkpoints load as they are; numerics follow its eager path op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision_tower import encoder_backend
from pagedserve_kernels import AttentionBackend


class BertEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions)[None])


class BertSelfAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.backend = encoder_backend(backend)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = (
            proj(x).view(b * length, self.num_heads, self.head_dim)
            for proj in (self.query, self.key, self.value)
        )
        out = self.backend.encoder_attention(q, k, v, [length] * b, mask=mask)  # [B*L, H, D]
        return out.reshape(b, length, -1)


class BertSublayerOutput(nn.Module):
    """dense -> LayerNorm(+ residual): BertSelfOutput and BertOutput are this shape."""

    def __init__(self, cfg, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, backend)
        self.output = BertSublayerOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        approximate = "tanh" if cfg.hidden_act in ("gelu_new", "gelu_pytorch_tanh") else "none"
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, backend)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSublayerOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.layer = nn.ModuleList(BertLayer(cfg, backend) for _ in range(n))


class BertModel(nn.Module):
    """forward(input_ids [B, L], lengths [B]) -> hidden [B, L, hidden] (rows past a length are
    padding: they attend, are attended by nothing, and are never pooled)."""

    is_encoder = True

    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT with relative position embeddings is not supported")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, backend)

    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, token_type_ids=None
    ) -> torch.Tensor:
        length = input_ids.shape[1]
        keep = torch.arange(length, device=input_ids.device)[None] < lengths[:, None]  # [B, L]
        mask = keep[:, None, None, :]  # [B, 1, 1, L]: which keys each query may see
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.embeddings(input_ids, types)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """HF names, with or without the `bert.` prefix; the pooler and heads are not used."""
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        state = {
            k: v
            for k, v in state.items()
            if not k.startswith(("pooler.", "cls.", "classifier."))
            and k != "embeddings.position_ids"
        }
        result = self.load_state_dict(state, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)


class BertPooler(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls))


class BertForSequenceClassification(nn.Module):
    """Cross-encoder (reranker): [CLS] a [SEP] b [SEP] -> pooler -> classifier logits."""

    is_encoder = True

    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, backend)
        self.bert.pooler = BertPooler(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, input_ids, lengths, token_type_ids=None) -> torch.Tensor:
        return self.bert(input_ids, lengths, token_type_ids)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, labels]
        return self.classifier(self.bert.pooler(cls_hidden))

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        state = {k: v for k, v in state.items() if k != "bert.embeddings.position_ids"}
        result = self.load_state_dict(state, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)
