"""Gemma 3 vision (Gemma3ForConditionalGeneration): the Gemma 3 text model, a SigLIP tower with
its post_layernorm, and Gemma 3's projector (average-pool the patch grid down to
mm_tokens_per_image, RMSNorm with (1 + weight), one matmul into the text width).

Per image the prompt holds "\\n\\n<start_of_image>" + mm_tokens_per_image soft tokens +
"<end_of_image>\\n\\n", as the folder's Gemma3Processor writes it. transformers makes attention
among one image's soft tokens bidirectional (token_type_ids; global layers: causal OR same image;
sliding layers: AND(window, causal OR same image)); our paged backends are causal, so
engine/models/gemma3_vl_attention.py recomputes the image tokens' query rows, and an image's
tokens are never split across prefill chunks (ImageInput.whole, engine/core/encoder_budget.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma3_vl_attention import ImageAwareAttention, StepImages
from engine.models.llava import _RENAMES, LlavaMixin, rename_prefix
from engine.models.vision_tower import VisionTower, activation
from pagedserve_kernels import AttentionMetadata

# parts of a SigLIP checkpoint Gemma 3 never reads: the pooling head, position ids
_UNUSED = ("vision_tower.head.", "vision_tower.embeddings.position_ids")


class Gemma3VisionTower(VisionTower):
    """SigLIP: the encoder's last hidden state through post_layernorm (last_hidden_state)."""

    def __init__(self, cfg, backend=None) -> None:
        super().__init__(cfg, backend)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, P, D]
        return self.post_layernorm(self.hidden_states(pixel_values, [-1])[0])


class Gemma3Projector(nn.Module):
    """[N, patches, vision D] -> [N, mm_tokens_per_image, text hidden], as transformers'
    Gemma3MultiModalProjector."""

    def __init__(self, cfg) -> None:
        super().__init__()
        vcfg, hidden = cfg.vision_config, cfg.get_text_config().hidden_size
        self.patches_per_side = vcfg.image_size // vcfg.patch_size
        tokens_per_side = int(cfg.mm_tokens_per_image**0.5)
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = RMSNorm(vcfg.hidden_size, vcfg.layer_norm_eps, unit_offset=True)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vcfg.hidden_size, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(n, d, side, side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, d).contiguous()).view(n, -1, d)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    supports_images = True
    prefill_images_whole = True  # bidirectional among an image's tokens: one chunk per image

    def __init__(self, cfg, backend) -> None:
        super().__init__(cfg.get_text_config(), backend)
        self.vl_config = cfg
        self.vision_tower = Gemma3VisionTower(cfg.vision_config, backend)
        self.multi_modal_projector = Gemma3Projector(cfg)
        self.image_token_id = cfg.image_token_id
        self.step_images = StepImages()
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.attn = ImageAwareAttention.wrap(attn.attn, self.step_images)

    @classmethod
    def check_config(cls, cfg, max_model_len: int) -> None:
        super().check_config(cfg.get_text_config(), max_model_len)
        vcfg = cfg.vision_config
        if getattr(vcfg, "model_type", None) != "siglip_vision_model":
            raise ValueError(f"vision tower {vcfg.model_type!r} is not supported (siglip only)")
        activation(vcfg.hidden_act)
        side, tokens = vcfg.image_size // vcfg.patch_size, int(cfg.mm_tokens_per_image**0.5)
        if tokens * tokens != cfg.mm_tokens_per_image or side % tokens:
            raise ValueError(
                f"mm_tokens_per_image {cfg.mm_tokens_per_image} does not pool a {side}x{side} "
                "patch grid evenly"
            )

    # ---- the image interface (engine/multimodal/processor.py, embedder.py) --------------------
    @staticmethod
    def image_token_id_of(cfg) -> int:
        return cfg.image_token_id

    @staticmethod
    def image_placeholder_text(cfg, tokenizer) -> str:
        """What the chat template sees per image part: Gemma3Processor's full image sequence
        with one soft token (expanded to mm_tokens_per_image after tokenizing)."""
        ids = [cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id]
        return "\n\n" + "".join(tokenizer.convert_ids_to_tokens(ids)) + "\n\n"

    @classmethod
    def num_image_tokens(cls, cfg, pixel_shape, grid_thw=None) -> int:
        return cfg.mm_tokens_per_image

    @staticmethod
    def pixels_of(processed) -> torch.Tensor:
        """One image's [3, H, W]; pan-and-scan crops (more than one per image) are refused."""
        pixels = processed["pixel_values"]
        if pixels.shape[0] != 1:  # engine/multimodal/processor.py names the part
            raise ValueError("do_pan_and_scan crops are not supported")
        return pixels[0]

    @classmethod
    def min_chunk_tokens(cls, cfg) -> int:
        """The fewest tokens a prefill step must take: one whole image."""
        return cfg.mm_tokens_per_image

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, mm_tokens_per_image, text hidden] (get_image_features)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the whole text vocabulary, as transformers: not this rank's shard, nor the embedding's
        # shape (a packed GGUF has none)
        vocab = self.vl_config.get_text_config().vocab_size
        if self.image_token_id >= vocab:  # as transformers: an out-of-vocabulary soft token
            input_ids = torch.where(input_ids == self.image_token_id, 0, input_ids)
        return self.embed(input_ids)

    def set_step_images(self, spans: list[tuple[int, int, int, int]]) -> None:
        """This step's image query rows (row, count, sequence, image end), from the embedder."""
        self.step_images.spans = spans

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: images merged in
    ) -> torch.Tensor:  # [T, hidden]
        if inputs_embeds is None:
            self.step_images.spans = []  # a text-only step (no stale spans)
            return super().forward(input_ids, positions, meta, kv_caches)
        x = inputs_embeds
        ropes = self.layer_ropes(positions, meta.max_seq_len, x.dtype)
        residual = None
        for layer, rope, kv_cache in zip(self.model.layers, ropes, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.model.norm(x, residual)[0]

    # our name of a checkpoint tensor: the loader's TP sharding looks the layer up by it
    checkpoint_name = staticmethod(LlavaMixin.checkpoint_name)

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        renamed = {rename_prefix(name, _RENAMES): tensor for name, tensor in state.items()}
        renamed = {n: t for n, t in renamed.items() if not n.startswith(_UNUSED)}
        if "lm_head.weight" not in renamed and "model.embed_tokens.weight" in renamed:
            renamed["lm_head.weight"] = renamed["model.embed_tokens.weight"]  # tied
        return super().load_weights(renamed)
