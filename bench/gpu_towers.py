"""bf16 images/s of full-size vision towers on a GPU, batch 1-64, to set the backend's GPU defaults.

For a session lent a GPU (the `device` tool): one short run, random weights (shapes are what
matter for speed), the forward pass only, after warm-up, CUDA-synchronized.

    python -m bench.gpu_towers [--device cuda] [--out results.json]
    python -m bench.gpu_towers --device cpu --tiny      # a smoke test of the script itself

Towers: SigLIP-so400m/14 at 384x384 (729 tokens, hidden 1152) and the Qwen2.5-VL-7B vision
transformer with its merger at 448x448 (1024 patches -> 256 tokens of 3584).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import SiglipVisionConfig, SiglipVisionModel
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

SIGLIP_SO400M = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14,
    image_size=384,
)  # fmt: skip
QWEN25_VL_7B = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    in_channels=3, hidden_act="silu",
)  # fmt: skip
TINY = {"siglip": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
        "qwen": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                     fullatt_block_indexes=[1])}  # fmt: skip


def build(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    if name == "siglip":
        config = SiglipVisionConfig(**{**SIGLIP_SO400M, **(TINY["siglip"] if tiny else {})})
        return SiglipVisionModel(config).to(device, dtype).eval(), config
    config = Qwen2_5_VLVisionConfig(**{**QWEN25_VL_7B, **(TINY["qwen"] if tiny else {})})
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config).to(device, dtype).eval(), config


def inputs(name: str, config: object, batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    if name == "siglip":
        size = config.image_size  # type: ignore[attr-defined]
        return {"pixel_values": torch.randn(batch, 3, size, size, device=device, dtype=dtype)}
    grid = 448 // 14  # 32 x 32 patches per image
    patch_dim = 3 * 2 * 14 * 14
    hidden = torch.randn(batch * grid * grid, patch_dim, device=device, dtype=dtype)
    thw = torch.tensor([[1, grid, grid]] * batch, device=device)
    return {"hidden_states": hidden, "grid_thw": thw}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, tiny: bool, device: torch.device, batches: list[int]) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, config = build(name, tiny, device, dtype)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            try:
                args = inputs(name, config, batch, device, dtype)
                for _ in range(2):
                    model(**args)
                sync(device)
                repeats, started = 0, time.perf_counter()
                while repeats < 3 or time.perf_counter() - started < 2.0:
                    model(**args)
                    repeats += 1
                sync(device)
                seconds = (time.perf_counter() - started) / repeats
                rows.append(
                    {"tower": name, "batch": batch, "images_per_s": batch / seconds, "ms_per_batch": seconds * 1000}
                )
            except torch.OutOfMemoryError:
                rows.append({"tower": name, "batch": batch, "error": "out of memory"})
                torch.cuda.empty_cache()
            print(rows[-1], flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: check the script, measure nothing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [1, 2] if args.tiny else [1, 2, 4, 8, 16, 32, 64]
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    rows = measure("siglip", args.tiny, device, batches) + measure("qwen", args.tiny, device, batches)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{info}\n\n| tower | batch | images/s | ms/batch |\n|---|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tower']} | {r['batch']} | {r['error']} | |")
        else:
            print(f"| {r['tower']} | {r['batch']} | {r['images_per_s']:.1f} | {r['ms_per_batch']:.1f} |")


if __name__ == "__main__":
    main()
