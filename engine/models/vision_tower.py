"""CLIP and SigLIP vision towers (the image encoders of LLaVA-style models), from our layers.

Images of one size run as one batch [N, 3, H, W] -> per-layer hidden states [N, P, D]; the
attention is bidirectional over an image's patches (the backend's encoder_attention, SDPA by
default; no KV cache: an image's embedding is computed once and kept in the encoder cache,
engine/multimodal/). Module and parameter names follow Hugging Face's CLIPVisionTransformer /
SiglipVisionTransformer (embeddings.patch_embedding, encoder.layers[i].self_attn.q_proj, ...),
so weights load as is.
Numerics follow transformers op for op (float32 greedy parity in tests/test_multimodal.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import Linear
from pagedserve_kernels import AttentionBackend

_SDPA = AttentionBackend()  # the seam's default encoder_attention: torch SDPA

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Linear over [..., in] as one [rows, in] GEMM (the packed CPU linears take 2-D input)."""
    return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def encoder_backend(backend: AttentionBackend | None) -> AttentionBackend:
    """The backend whose encoder_attention a tower runs: the model's, else plain SDPA."""
    return _SDPA if backend is None else backend


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class VisionEmbeddings(nn.Module):
    """Patches (a strided conv), CLIP's class token in front, learned absolute positions."""

    def __init__(self, cfg, has_class_token: bool) -> None:
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_size = p
        self.has_class_token = has_class_token
        if has_class_token:
            self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, d, kernel_size=p, stride=p, bias=not has_class_token
        )
        num_positions = (cfg.image_size // p) ** 2 + int(has_class_token)
        self.position_embedding = nn.Embedding(num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, P, D]
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        if self.has_class_token:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"image of {x.shape[1]} patches; the tower's positions cover "
                f"{self.position_embedding.num_embeddings} (resize to the configured image_size)"
            )
        return x + self.position_embedding.weight.unsqueeze(0)


class VisionAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.backend = encoder_backend(backend)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = d // self.num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj, self.k_proj = Linear(d, d, bias=True), Linear(d, d, bias=True)
        self.v_proj, self.out_proj = Linear(d, d, bias=True), Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D], bidirectional
        n, p, _ = x.shape
        q, k, v = (
            rows(proj, x).view(n * p, self.num_heads, self.head_dim)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = self.backend.encoder_attention(q, k, v, [p] * n, self.scale)  # [N*P, H, Dh]
        return rows(self.out_proj, out.reshape(n, p, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows(self.fc2, self.act(rows(self.fc1, x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        eps = cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = VisionAttention(cfg, backend)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, backend) for _ in range(n))


class VisionTower(nn.Module):
    """CLIP (class token, pre-layernorm, quick_gelu) or SigLIP (neither, conv bias)."""

    def __init__(self, cfg, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.is_clip = "siglip" not in getattr(cfg, "model_type", "clip_vision_model")
        self.embeddings = VisionEmbeddings(cfg, has_class_token=self.is_clip)
        if self.is_clip:  # HF's spelling
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = VisionEncoder(cfg, backend)

    @property
    def num_positions(self) -> int:
        return self.embeddings.position_embedding.num_embeddings

    def hidden_states(self, pixel_values: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        """HF's hidden_states[i] for each i in wanted (0: the embeddings, k: after layer k;
        negative from the end), running only the layers they need."""
        n = len(self.encoder.layers)
        wanted = [i % (n + 1) for i in wanted]
        x = self.embeddings(pixel_values)
        if self.is_clip:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for k, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = states[k] = layer(x)
        return [states[i] for i in wanted]


def num_patch_tokens(cfg) -> int:
    """Tokens per image out of the tower (class token included) at the configured size."""
    return (cfg.image_size // cfg.patch_size) ** 2 + int("siglip" not in cfg.model_type)
