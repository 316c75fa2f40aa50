"""LLaVA-style vision-language models: a CLIP or SigLIP tower, an MLP projector, and a text
model of a family we already serve (Llama, Qwen2, Mistral, ...).

`llava_class(text_cls)` is the text family's class with the image side added (LlavaMixin):
the runner sees the text model as usual (model.layers, lm_head, forward), plus the image
interface engine/multimodal/ uses: image_token_id, num_image_tokens(pixel shape),
embed_images(pixel_values) and embed_input_ids(ids); forward takes inputs_embeds.
Checkpoint names of both layouts load (language_model.model.* of the classic llava-hf
folders, model.language_model.* of transformers 5).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers import Linear
from engine.models.vision_tower import VisionTower, activation, num_patch_tokens, rows

_RENAMES = (  # checkpoint prefix -> ours; first match wins
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# tower parts LLaVA never reads: the last norm, SigLIP's pooling head, CLIP's position ids
_UNUSED = (
    "vision_tower.post_layernorm.",
    "vision_tower.head.",
    "vision_tower.embeddings.position_ids",
)
_TOWERS = ("clip_vision_model", "siglip_vision_model")
_STRATEGIES = ("default", "full")


class LlavaProjector(nn.Module):
    def __init__(self, cfg, in_features: int) -> None:
        super().__init__()
        bias = getattr(cfg, "multimodal_projector_bias", True)
        out = cfg.get_text_config().hidden_size
        self.linear_1 = Linear(in_features, out, bias=bias)
        self.act = activation(cfg.projector_hidden_act)
        self.linear_2 = Linear(out, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _feature_layers(cfg) -> list[int]:
    layer = cfg.vision_feature_layer
    return [layer] if isinstance(layer, int) else list(layer)


def image_token_id_of(cfg) -> int:
    value = getattr(cfg, "image_token_id", None)
    return value if value is not None else cfg.image_token_index


def rename_prefix(name: str, renames) -> str:
    """`name` with its first matching checkpoint prefix replaced by ours (renames: (old, new))."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class LlavaMixin:
    """The image side of a LLaVA model; the text side is the class it is mixed into."""

    supports_images = True

    def __init__(self, cfg, backend) -> None:
        super().__init__(cfg.get_text_config(), backend)
        self.vl_config = cfg
        vcfg = cfg.vision_config
        self.vision_tower = VisionTower(vcfg, backend)
        self.feature_layers = _feature_layers(cfg)
        self.drop_first = cfg.vision_feature_select_strategy == "default"
        in_features = vcfg.hidden_size * len(self.feature_layers)
        self.multi_modal_projector = LlavaProjector(cfg, in_features)
        self.image_token_id = image_token_id_of(cfg)

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        super().check_config(cfg.get_text_config(), max_model_len)
        tower = getattr(cfg.vision_config, "model_type", None)
        if tower not in _TOWERS:
            raise ValueError(f"vision tower {tower!r} is not supported ({', '.join(_TOWERS)})")
        strategy = cfg.vision_feature_select_strategy
        if strategy not in _STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        activation(cfg.projector_hidden_act)
        activation(cfg.vision_config.hidden_act)

    @classmethod
    def num_image_tokens(cls, cfg, pixel_shape: tuple[int, ...], grid_thw=None) -> int:
        """Placeholder tokens of one image (its preprocessed [3, H, W] shape)."""
        drop_first = cfg.vision_feature_select_strategy == "default"
        return num_patch_tokens(cfg.vision_config) - int(drop_first)

    image_token_id_of = staticmethod(image_token_id_of)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, num_image_tokens, text hidden], as HF's get_image_features."""
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        if self.drop_first:
            states = [s[:, 1:] for s in states]
        return rows(self.multi_modal_projector, torch.cat(states, dim=-1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Our name of checkpoint tensor `name` (the loader's TP sharding looks the layer up)."""
        return rename_prefix(name, _RENAMES)

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        renamed = {rename_prefix(name, _RENAMES): tensor for name, tensor in state.items()}
        return super().load_weights({n: t for n, t in renamed.items() if not n.startswith(_UNUSED)})


@functools.cache
def llava_class(text_cls: type[nn.Module]) -> type[nn.Module]:
    """The LLaVA model class whose text side is text_cls (made once per family)."""
    return type(f"Llava{text_cls.__name__}", (LlavaMixin, text_cls), {})
