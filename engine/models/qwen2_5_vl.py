"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): the Qwen2 text model with M-RoPE positions
(engine/layers/mrope.py) and the vision tower of engine/models/qwen2_5_vl_vision.py.

The image interface engine/multimodal/ uses: the image processor's output for one image becomes
(patches [t*h*w, C*T*P*P], grid (t, h, w)); the chat template sees
<|vision_start|><|image_pad|><|vision_end|> per image and the pad expands to one token per
merged 2x2 patch block; encode_images runs the tower over several images at once. The runner's
per-token (t, h, w) positions come from engine/multimodal/mrope.py (uses_mrope).
Both checkpoint layouts load: the classic (model.layers.*, visual.*) and transformers 5's
(model.language_model.*, model.visual.*).
"""

from __future__ import annotations

import torch

from engine.layers.mrope import MRotaryEmbedding
from engine.layers.rotary_scaling import rope_parameters, rope_theta, rope_type
from engine.models.llama import head_dim_of
from engine.models.llava import rename_prefix
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_5_vl_vision import Qwen2_5_VisionTower

_RENAMES = (  # checkpoint prefix -> ours; first match wins
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_PATCH_CONV = "visual.patch_embed.proj.weight"


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_images = True
    uses_mrope = True

    def __init__(self, cfg, backend) -> None:
        text = cfg.get_text_config()
        super().__init__(text, backend)
        self.vl_config = cfg
        section = rope_parameters(text).get("mrope_section")
        self.rotary = MRotaryEmbedding(head_dim_of(text), rope_theta(text), section)
        self.visual = Qwen2_5_VisionTower(cfg.vision_config, backend)
        self.spatial_merge = cfg.vision_config.spatial_merge_size
        self.image_token_id = cfg.image_token_id
        self.tie_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        text = cfg.get_text_config()
        super().check_config(text, max_model_len)
        if rope_type(text) != "default" or not rope_parameters(text).get("mrope_section"):
            raise ValueError("Qwen2.5-VL needs default M-RoPE (rope_parameters.mrope_section)")

    # ---- the image interface (engine/multimodal/processor.py, embedder.py) --------------------
    @staticmethod
    def image_token_id_of(cfg) -> int:
        return cfg.image_token_id

    @staticmethod
    def image_placeholder_text(cfg, tokenizer) -> str:
        """What the chat template sees per image part (the pad expands later)."""
        ids = (cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
        return "".join(tokenizer.convert_ids_to_tokens(list(ids)))

    @staticmethod
    def pixels_of(processed) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image's (patches, grid (t, h, w) in patches) from the image processor's output."""
        grid = tuple(int(v) for v in processed["image_grid_thw"][0].tolist())
        return processed["pixel_values"], grid

    @classmethod
    def num_image_tokens(cls, cfg, pixel_shape, grid_thw=None) -> int:
        t, h, w = grid_thw
        return t * h * w // cfg.vision_config.spatial_merge_size**2

    def encode_images(self, pixels: list[torch.Tensor], grids: list[tuple]) -> list[torch.Tensor]:
        """Each image's [tokens, text hidden], the images run through the tower together."""
        merged = self.visual(torch.cat(pixels), grids)
        return list(merged.split([t * h * w // self.spatial_merge**2 for t, h, w in grids]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Our name of checkpoint tensor `name` (the loader's TP sharding looks the layer up)."""
        return rename_prefix(name, _RENAMES)

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        renamed = {}
        for name, tensor in state.items():
            name = rename_prefix(name, _RENAMES)
            if name == _PATCH_CONV:  # Conv3d [D, C, T, P, P] -> Linear [D, C*T*P*P]
                name, tensor = "visual.patch_embed.linear.weight", tensor.flatten(1)
            renamed[name] = tensor
        if self.tie_embeddings and "lm_head.weight" not in renamed:
            renamed["lm_head.weight"] = renamed.get("model.embed_tokens.weight")
        return super().load_weights({k: v for k, v in renamed.items() if v is not None})
