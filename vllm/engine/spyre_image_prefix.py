"""Prefix caching of prompts with images, keyed by the images' content.

vLLM 0.10.1.1's V0 engine turns ``--enable-prefix-caching`` off for a
multimodal model (``EngineArgs._set_default_args_v0``): its block hashes
hold a prompt's token ids, and two prompts with the same text and other
images hold the same ids, their images' placeholders.  ``install`` (a
``vllm.general_plugins`` entry point) does two things on Spyre:

* the flag is kept for a multimodal model (upstream's other checks of it
  stand);
* a sequence with images adds their digest to its blocks' hashes
  (``Sequence.extra_hash``, which the block manager folds into every
  block's hash as it fills, beside a LoRA adapter's id): a digest of the
  image tensors vLLM's processor made of the request's images, computed
  once per sequence.  Two prompts share a cached block only if their
  tokens up to it and their images are the same; a prompt without images
  hashes as before.

The runner needs nothing more: a prefill that starts after cached blocks
embeds the whole prompt with its images and takes the positions it
computes, or, when no image placeholder is left among them, runs as a
text prefill without the vision tower (``spyre_image_inputs``).
"""
from __future__ import annotations

import hashlib

from vllm.engine.spyre_upstream_wraps import wrap_once
from vllm.logger import init_logger

logger = init_logger(__name__)

_DIGEST = "_spyre_image_digest"


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sequence import Sequence
    wrap_once(EngineArgs, "_set_default_args_v0", _keeping_prefix_caching)
    wrap_once(Sequence, "extra_hash", _with_images)


def _spyre() -> bool:
    from vllm.config.spyre import is_spyre
    return is_spyre()


def _keeping_prefix_caching(original):

    def set_default_args_v0(args, model_config, *rest, **kwargs):
        keep = (args.enable_prefix_caching and _spyre()
                and model_config.is_multimodal_model
                and args.prefix_caching_hash_algo != "sha256")
        if not keep:
            return original(args, model_config, *rest, **kwargs)
        args.enable_prefix_caching = False
        try:
            original(args, model_config, *rest, **kwargs)
        finally:
            args.enable_prefix_caching = True
        logger.info("Prefix caching of prompts with images: cached blocks "
                    "are keyed by the images' content as well as the "
                    "tokens")

    return set_default_args_v0


def _with_images(original):

    def extra_hash(seq):
        extra = original(seq)
        # Called for every sequence at every step: the cheap test first.
        if seq.inputs.get("type") != "multimodal" or not _spyre():
            return extra
        digest = seq.__dict__.get(_DIGEST)
        if digest is None:
            digest = image_digest(seq.multi_modal_data)
            seq.__dict__[_DIGEST] = digest
        return hash((extra, digest))

    return extra_hash


def image_digest(mm_kwargs) -> bytes:
    """A digest of a request's multimodal inputs: every tensor's path,
    dtype, shape and bytes, in a fixed order."""
    import torch

    from vllm.worker.spyre_image_inputs import flat_tensors
    digest = hashlib.blake2b(digest_size=16)
    for path, tensor in sorted(flat_tensors(mm_kwargs).items()):
        digest.update(f"{path}:{tensor.dtype}:{tuple(tensor.shape)}"
                      .encode())
        digest.update(tensor.cpu().view(-1).view(torch.uint8).numpy()
                      .tobytes())
    return digest.digest()
