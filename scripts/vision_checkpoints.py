"""Write vision-language benchmark checkpoints: random weights at a
LLaVA-NeXT's shapes, with the default model's tokenizer and an `<image>`
placeholder added to it, and the processor beside them.

Speed depends on shapes, not values, so a random checkpoint measures what
serving the real one costs (its text is noise).  Shapes (``SHAPES``):

* ``smol-vision``: SmolLM2-135M's language model under a SigLIP of
  SigLIP-base's size (12 layers of 768, 224-pixel tiles of 16-pixel
  patches): small enough to run beside transformers in minutes;
* ``granite-vision-3.3-2b``: Granite Vision 3.3 2B's: Granite 3.3 2B's
  language model under SigLIP-so400m (27 layers of 1152, 384-pixel tiles
  of 14-pixel patches), features of four of its layers.

Any-resolution grids of up to 2 x 2 tiles.

    python scripts/vision_checkpoints.py [--shapes smol-vision]
        [--out models/bench]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "models" / "SmolLM2-135M-Instruct"

SHAPES = {
    "smol-vision": dict(
        text=dict(model_type="llama", architectures=["LlamaForCausalLM"],
                  hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, rope_theta=100000.0,
                  max_position_embeddings=8192, rms_norm_eps=1e-5,
                  tie_word_embeddings=True),
        vision=dict(hidden_size=768, intermediate_size=3072,
                    num_hidden_layers=12, num_attention_heads=12,
                    image_size=224, patch_size=16),
        feature_layers=[-1]),
    "granite-vision-3.3-2b": dict(
        text=dict(model_type="granite", architectures=["GraniteForCausalLM"],
                  hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=40, num_attention_heads=32,
                  num_key_value_heads=8, rope_theta=300000.0,
                  max_position_embeddings=131072, rms_norm_eps=1e-5,
                  embedding_multiplier=12.0, attention_multiplier=0.015625,
                  residual_multiplier=0.22, logits_scaling=8.0,
                  tie_word_embeddings=True),
        vision=dict(hidden_size=1152, intermediate_size=4304,
                    num_hidden_layers=27, num_attention_heads=16,
                    image_size=384, patch_size=14),
        feature_layers=[-24, -20, -12, -1]),
}


def write(shape: str, out: Path, seed: int = 0) -> Path:
    from transformers import (AutoConfig, AutoTokenizer, LlavaNextConfig,
                              LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor,
                              SiglipVisionConfig)
    if (out / "config.json").exists():
        print(f"{out} is written already")
        return out
    start = time.perf_counter()
    spec = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text = dict(spec["text"])
    model_type = text.pop("model_type")
    text_config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), bos_token_id=1,
        eos_token_id=2, pad_token_id=2, torch_dtype="bfloat16", **text)
    vision = SiglipVisionConfig(**spec["vision"])
    side = vision.image_size
    grids = [[side, side], [side, 2 * side], [2 * side, side],
             [2 * side, 2 * side]]
    config = LlavaNextConfig(
        vision_config=vision, text_config=text_config,
        image_token_index=image_id, vision_feature_select_strategy="full",
        vision_feature_layer=spec["feature_layers"],
        image_grid_pinpoints=grids,
        tie_word_embeddings=text_config.tie_word_embeddings)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlavaNextForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    images = LlavaNextImageProcessor(
        size={"height": side, "width": side},
        crop_size={"height": side, "width": side},
        image_grid_pinpoints=grids, image_mean=[0.5] * 3,
        image_std=[0.5] * 3)
    LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer,
        patch_size=vision.patch_size, vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        image_token="<image>").save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e9:.2f} B parameters in "
          f"{time.perf_counter() - start:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smol-vision",
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--out", default=str(ROOT / "models" / "bench"))
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}: of "
                             f"{', '.join(SHAPES)}")
        write(shape, Path(args.out) / f"{shape}-bf16")


if __name__ == "__main__":
    main()
