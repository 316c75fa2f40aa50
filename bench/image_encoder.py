"""Time per image in the vision encoder (tower + projector): ours against transformers' own
get_image_features, on the same random weights and pixels, in one run.

Shapes: LLaVA 1.5's CLIP ViT-L/14-336 tower (1024 wide, 16 heads, 4096 MLP, 577 tokens per
image) with its layer count cut (--layers, default 4) and a 2048-wide projector; float32 and
bfloat16 (ours runs its packed CPU linears in bf16). Prints seconds per image and the ratio.

    PYTHONPATH=$PWD python bench/image_encoder.py --layers 4 --images 4 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import time

import torch


def build(layers: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    vision = CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
        num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=512, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=16, num_key_value_heads=16,
    )  # fmt: skip
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=511,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )  # fmt: skip
    cfg.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    return cfg, HFLlava(cfg).float().eval()


def ours_from(cfg, hf, dtype: torch.dtype):
    from engine.layers import select_impls
    from engine.models import get_model_class
    from pagedserve_kernels import get_attention_backend
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    backend = get_attention_backend("auto", "cpu", 16, dtype)
    model = get_model_class(cfg)(cfg, backend)
    missing, unexpected = model.load_weights(hf.state_dict())
    assert not [m for m in missing if "vision" in m or "projector" in m], missing
    model = model.to(dtype=dtype).eval()
    select_impls(model, load_cpu_ops())
    return model


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (packing, oneDNN primitives)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg, hf = build(args.layers)
    pixels = torch.randn(args.images, 3, 336, 336)
    print(f"CLIP-L/14-336 tower, {args.layers} layers, {args.images} images per batch")
    print(f"{'dtype':<10}{'ours s/img':>12}{'HF s/img':>12}{'HF/ours':>9}{'max |diff|':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        ours = ours_from(cfg, hf, dtype)
        ref = hf.to(dtype)
        x = pixels.to(dtype)
        with torch.inference_mode():
            a = ours.embed_images(x).float()
            b = torch.stack(list(ref.get_image_features(x).pooler_output)).float()
            t_ours = timed(functools.partial(ours.embed_images, x), args.repeats)
            t_hf = timed(functools.partial(ref.get_image_features, x), args.repeats)
        n = args.images
        name = str(dtype).removeprefix("torch.")
        diff = (a - b).abs().max().item()
        print(f"{name:<10}{t_ours / n:>12.4f}{t_hf / n:>12.4f}{t_hf / t_ours:>9.2f}{diff:>12.2e}")


if __name__ == "__main__":
    main()
