"""Tiny random vision-language checkpoints, built offline: a LLaVA-NeXT
(Granite Vision's architecture: a SigLIP vision tower, a projector and a
Granite language model) with its processor, for the image tests."""
from __future__ import annotations

from pathlib import Path

from spyre_support.tiny_models import _common, _save, build_tokenizer

#: The image placeholder's token id in the tiny checkpoints.
IMAGE_TOKEN_ID = 4
#: The vision tower's input side and patch, in pixels.
IMAGE_SIDE, PATCH = 32, 8


def build_tiny_llava_next(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Granite (4 heads of 16, 2 key/value heads, its
    multipliers) under a 2-layer SigLIP (2 heads: tensor parallelism
    over 2 ranks splits both) of 32-pixel tiles in 8-pixel
    patches, any-resolution grids of up to 2 x 2 tiles; the processor
    beside it (the slow image processor: the fast one needs
    torchvision)."""
    import torch
    from transformers import (GraniteConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor,
                              SiglipVisionConfig)
    tokenizer = build_tokenizer(
        specials=("<pad>", "<s>", "</s>", "<unk>", "<image>"))
    text = GraniteConfig(**_common(len(tokenizer), 4),
                         num_key_value_heads=2, embedding_multiplier=2.0,
                         attention_multiplier=0.2, residual_multiplier=0.5,
                         logits_scaling=1.5,
                         architectures=["GraniteForCausalLM"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIDE, patch_size=PATCH)
    side = IMAGE_SIDE
    grids = [[side, side], [side, 2 * side], [2 * side, side],
             [2 * side, 2 * side]]
    config = LlavaNextConfig(
        vision_config=vision, text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_select_strategy="full",
        vision_feature_layer=[-2, -1], image_grid_pinpoints=grids,
        tie_word_embeddings=False)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():  # the image newline starts at zero
        model.model.image_newline.normal_(0, 0.3)
    images = LlavaNextImageProcessor(
        size={"height": side, "width": side},
        crop_size={"height": side, "width": side},
        image_grid_pinpoints=grids, image_mean=[0.5] * 3,
        image_std=[0.5] * 3)
    processor = LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0, image_token="<image>")
    _save(model, tokenizer, out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def image(width: int, height: int, seed: int = 0):
    """A PIL image of random colours."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(
        rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def build_tiny_mistral3(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Mistral (4 heads of 16, 2 key/value heads) under a
    2-layer Pixtral vision model (2 heads) of 8-pixel patches, images of
    up to 64 pixels a side at their own aspect ratio, merged 2 x 2; the
    processor beside it (the slow image processor)."""
    import torch
    from transformers import (Mistral3Config,
                              Mistral3ForConditionalGeneration,
                              MistralConfig, PixtralImageProcessor,
                              PixtralProcessor, PixtralVisionConfig)
    tokenizer = build_tokenizer(
        specials=("<pad>", "<s>", "</s>", "<unk>", "[IMG]", "[IMG_BREAK]",
                  "[IMG_END]"))
    text = MistralConfig(**_common(len(tokenizer), 4),
                         num_key_value_heads=2, head_dim=16,
                         sliding_window=None,
                         architectures=["MistralForCausalLM"])
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 image_size=64, patch_size=PATCH)
    config = Mistral3Config(vision_config=vision, text_config=text,
                            image_token_index=IMAGE_TOKEN_ID,
                            spatial_merge_size=2,
                            projector_hidden_act="gelu",
                            multimodal_projector_bias=False,
                            tie_word_embeddings=False)
    config.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).eval()
    images = PixtralImageProcessor(
        size={"longest_edge": 64},
        patch_size={"height": PATCH, "width": PATCH},
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = PixtralProcessor(image_processor=images, tokenizer=tokenizer,
                                 patch_size=PATCH, spatial_merge_size=2)
    _save(model, tokenizer, out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
