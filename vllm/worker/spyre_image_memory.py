"""What a vision-language model's images add to the up-front memory check.

The vision tower's and projector's weights are in the checkpoint and
counted with the rest (``spyre_memory.weights_of``).  What the check adds
here is the largest step of images: a prefill whose prompt holds as many
images as ``--limit-mm-per-prompt`` allows, each of the largest size the
processor makes (LLaVA-NeXT: the base tile and the largest grid of
``image_grid_pinpoints``; Pixtral: ``image_size`` square), run through
the vision tower at once (``spyre_image_inputs``):

* the tower's hidden states, every layer's when features are taken from
  several layers (vLLM's towers then keep them all), else two;
* one layer's transients: its norm, q/k/v, the attention's output and
  projection, the MLP's two intermediates and its output.  PyTorch's CPU
  attention holds no ``[heads, tokens, tokens]`` scores, with or without
  a mask; Pixtral's block mask over all its images' patches, in float32,
  is counted;
* the projector's input (the features of every sampled layer side by
  side) and its three outputs at the language model's width;
* the prompt's embeddings, with the images merged, held while it
  prefills (two copies: the merge and the prefill's input).

The check adds this to the language model's own largest step: the tower
runs before the prefill that uses its output, but its freed buffers stay
in the heap for the passes to come (``spyre_heap.keep_large_buffers``),
where the prefill's tensors of other sizes do not all fit.
"""
from __future__ import annotations

import dataclasses

from vllm.worker import spyre_memory


@dataclasses.dataclass(frozen=True)
class VisionSize:
    """The largest images' step, as the tower sees it."""

    tokens: int  # patches of every image of one prompt, together
    hidden: int
    intermediate: int
    kept_states: int  # hidden states the tower keeps at once
    sampled_layers: int  # layers the projector takes features from
    mask_tokens: int  # side of a float32 ``[N, N]`` mask (0: none)
    described: str


def vision_size(hf_config, images: int) -> VisionSize:
    vision = hf_config.vision_config
    side, patch = vision.image_size, vision.patch_size
    per_tile = (side // patch)**2
    model_type = getattr(hf_config, "model_type", "")
    layers = getattr(hf_config, "vision_feature_layer", -1)
    sampled = len(layers) if isinstance(layers, (list, tuple)) else 1
    kept = vision.num_hidden_layers + 1 if sampled > 1 else 2
    if model_type == "llava_next":
        grids = getattr(hf_config, "image_grid_pinpoints", None) or [[side,
                                                                      side]]
        tiles = 1 + max((h // side) * (w // side) for h, w in grids)
        tokens = images * tiles * per_tile
        mask = 0
        described = (f"{images} image(s) of {tiles} tiles of {per_tile} "
                     "patches")
    else:  # Pixtral: an image at its own size, up to image_size square
        tokens = images * per_tile
        mask = tokens
        described = (f"{images} image(s) of {side}x{side} pixels, "
                     f"{per_tile} patches each")
    return VisionSize(tokens, vision.hidden_size, vision.intermediate_size,
                      kept, sampled, mask, described)


def image_step_bytes(hf_config, images: int, text_hidden: int,
                     max_model_len: int, item: int) -> tuple[int, str]:
    """Peak bytes of the largest images' step, and what it is sized for."""
    size = vision_size(hf_config, images)
    per_token = (size.kept_states * size.hidden +
                 7 * size.hidden + 2 * size.intermediate +
                 size.sampled_layers * size.hidden + 3 * text_hidden)
    tower = size.tokens * per_token * item + 4 * size.mask_tokens**2
    prompt = 2 * max_model_len * text_hidden * item
    return tower + prompt, size.described


def with_images(estimate: spyre_memory.Estimate, vllm_config,
                item: int) -> spyre_memory.Estimate:
    """``estimate`` with the activations of the largest images' step, for a
    model that takes images; else as it is."""
    model_config = vllm_config.model_config
    if not model_config.is_multimodal_model:
        return estimate
    limits = model_config.multimodal_config.limit_per_prompt or {}
    images = max(1, limits.get("image", 1))
    step, described = image_step_bytes(
        model_config.hf_config, images,
        model_config.hf_text_config.hidden_size,
        vllm_config.scheduler_config.max_model_len, item)
    return dataclasses.replace(
        estimate, activations=estimate.activations + step,
        sized_for=f"{estimate.sized_for}, and a prompt's images ("
        f"{described}) through the vision tower")
