"""Time per image in Qwen2.5-VL's vision encoder (tower + merger): ours against transformers'
get_image_features, same random weights and pixels, one run.

Shapes: Qwen2.5-VL-3B's tower (1280 wide, 16 heads, 3420 MLP, patches of 14, windows of 112
pixels, 2x2 merge into 2048) with its depth cut (--layers, default 4; the last one full
attention), 448x448 images (1024 patches, 256 tokens each). float32 and bfloat16 (ours runs
its packed CPU linears in bf16). Loads transformers' state dict through our loader's renames.

    PYTHONPATH=$PWD python bench/qwen_vl_encoder.py --layers 4 --images 2 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import time

import torch


def build(layers: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        depth=layers, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
        window_size=112, out_hidden_size=2048, fullatt_block_indexes=[layers - 1],
    )  # fmt: skip
    text = dict(
        vocab_size=512, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=16, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=511)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    return cfg, Qwen2_5_VLForConditionalGeneration(cfg).float().eval()


def ours_from(cfg, hf, dtype: torch.dtype):
    from engine.layers import select_impls
    from engine.models import get_model_class
    from pagedserve_kernels import get_attention_backend
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    backend = get_attention_backend("auto", "cpu", 16, dtype)
    model = get_model_class(cfg)(cfg, backend)
    missing, unexpected = model.load_weights(hf.state_dict())
    assert not missing and not unexpected, (missing, unexpected)
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
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg, hf = build(args.layers)
    n, grid = args.images, (1, 32, 32)  # 448x448 pixels
    patches = torch.randn(n * 1024, 3 * 2 * 14 * 14)
    grids = torch.tensor([grid] * n)
    print(f"Qwen2.5-VL-3B tower, {args.layers} layers, {n} images of 448x448 per call")
    print(f"{'dtype':<10}{'ours s/img':>12}{'HF s/img':>12}{'HF/ours':>9}{'max |diff|':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        ours = ours_from(cfg, hf, dtype)
        ref = hf.to(dtype)
        x = patches.to(dtype)
        with torch.inference_mode():
            a = torch.cat(ours.encode_images([x], [grid] * n)).float()
            b = torch.cat(ref.model.get_image_features(x, grids).pooler_output).float()
            t_ours = timed(functools.partial(ours.encode_images, [x], [grid] * n), args.repeats)
            t_hf = timed(functools.partial(ref.model.get_image_features, x, grids), args.repeats)
        name = str(dtype).removeprefix("torch.")
        diff = (a - b).abs().max().item()
        print(f"{name:<10}{t_ours / n:>12.4f}{t_hf / n:>12.4f}{t_hf / t_ours:>9.2f}{diff:>12.2e}")


if __name__ == "__main__":
    main()
