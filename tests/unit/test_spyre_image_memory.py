"""The images' part of the up-front memory check
(``vllm.worker.spyre_image_memory``): the patches of a prompt's largest
images, as each architecture's processor makes them."""
from __future__ import annotations

from vllm.worker.spyre_image_memory import image_step_bytes, vision_size


def llava_next(grids, layers=-1):
    from transformers import LlavaNextConfig, SiglipVisionConfig
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                num_hidden_layers=3, image_size=28,
                                patch_size=14)
    return LlavaNextConfig(vision_config=vision, image_grid_pinpoints=grids,
                           vision_feature_layer=layers)


def mistral3():
    from transformers import Mistral3Config, PixtralVisionConfig
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=3, image_size=64,
                                 patch_size=16)
    return Mistral3Config(vision_config=vision)


def test_llava_next_counts_the_base_tile_and_the_largest_grid():
    """A 28-pixel tile of 14-pixel patches holds 4; the largest grid
    (56 x 84 pixels) is 6 tiles, plus the base tile."""
    size = vision_size(llava_next([[28, 28], [56, 84], [84, 28]]), images=2)
    assert size.tokens == 2 * 7 * 4
    assert size.mask_tokens == 0
    assert size.kept_states == 2 and size.sampled_layers == 1
    assert size.described == "2 image(s) of 7 tiles of 4 patches"


def test_features_of_several_layers_keep_every_hidden_state():
    size = vision_size(llava_next([[28, 28]], layers=[-2, -1]), images=1)
    assert size.kept_states == 3 + 1 and size.sampled_layers == 2


def test_pixtral_counts_its_largest_image_and_its_block_mask():
    """A 64-pixel square of 16-pixel patches: 16 patches an image, all
    a prompt's images in one sequence under a float32 block mask."""
    config = mistral3()
    size = vision_size(config, images=3)
    assert size.tokens == size.mask_tokens == 3 * 16
    with_mask, _ = image_step_bytes(config, 3, 48, 0, 4)
    one, _ = image_step_bytes(config, 1, 48, 0, 4)
    assert with_mask - 3 * one == 4 * (48**2 - 3 * 16**2)


def test_the_prompt_embeddings_grow_with_the_model_length():
    config = llava_next([[28, 28]])
    short, _ = image_step_bytes(config, 1, 48, 100, 4)
    long, _ = image_step_bytes(config, 1, 48, 200, 4)
    assert long - short == 2 * 100 * 48 * 4
