"""Loading an FMS encoder (BERT, RoBERTa) for Spyre from a Hugging Face
folder.

``SpyreEncoderModel`` builds FMS's encoder modules from
``fms_encoder_config`` with the strategy of ``tp_strategy``, then
``load_encoder_weights`` fills them through FMS's ``hf`` adapter of the
family (which names, fuses and, under tensor parallelism, shards the
weights) and refuses a checkpoint that leaves any weight unset.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def fms_encoder_config(family, hf_config):
    """FMS's encoder configuration for ``hf_config`` (FMS's own parameter
    builders, by the family)."""
    from fms.models.roberta import (RoBERTaClassificationConfig,
                                    RoBERTaConfig)
    params = family.params(hf_config)
    # Positions are always given (packed texts restart at 0), so FMS must
    # not derive them from a padding id, nor zero the embedding of a token
    # that happens to have that id.
    params.update(pos_emb="roberta", pad_id=None, p_dropout=0.0)
    config_cls = (RoBERTaClassificationConfig
                  if family.classify else RoBERTaConfig)
    return config_cls(**params)


def tp_strategy(tp_size: int):
    """FMS's distributed strategy of an encoder over ``tp_size`` ranks."""
    from fms.distributed.strategy import (NoOpStrategy,
                                          TensorParallelStrategy)
    if tp_size == 1:
        return NoOpStrategy

    class LayersOnly(TensorParallelStrategy):
        """Shards the encoder blocks; the embeddings stay whole (gloo, the
        CPU process group, lacks the all-gather FMS's sharded embedding
        needs, and they are a small part of an encoder)."""

        def _distribute_module(self, module, final_layers=False):
            return module

    import torch.distributed as dist
    return LayersOnly(group=dist.group.WORLD)


def load_encoder_weights(encoder: nn.Module, path: str, family,
                         dtype: torch.dtype, tp_size: int) -> None:
    """Fills ``encoder`` (in ``dtype``) from the checkpoint in ``path``;
    a ``ValueError`` names every weight the checkpoint does not provide."""
    from fms.utils.serialization import load_state_dict_into_model
    encoder.to(dtype)
    with torch.no_grad():
        for _, tensor in _named_float_tensors(encoder):
            tensor.fill_(float("nan"))
    load_state_dict_into_model(
        encoder, checkpoint_tensors(path, family),
        architecture=family.fms_architecture, source="hf", dtype=dtype,
        distributed_strategy="tp" if tp_size > 1 else None)
    missing = [name for name, t in _named_float_tensors(encoder)
               if torch.isnan(t).any()]
    if missing:
        raise ValueError(
            f"The checkpoint in {path} does not provide these weights of "
            f"the {family.hf_architecture} encoder: {', '.join(missing)}")
    encoder.eval()
    encoder.requires_grad_(False)


def checkpoint_tensors(path: str, family) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, named as FMS's adapter expects: the
    family's prefix added where a base model's checkpoint lacks it,
    and the pooler a base model never uses left out."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            tensors.update(load_file(str(f)))
    else:
        for f in sorted(folder.glob("*.bin")):
            tensors.update(torch.load(f, map_location="cpu",
                                      weights_only=True))
    prefix = family.prefix
    named = {}
    for name, tensor in tensors.items():
        if name.startswith(("embeddings.", "encoder.", "pooler.")):
            name = prefix + name
        if name.endswith("position_ids"):
            continue  # a buffer some checkpoints carry, not a weight
        if not family.classify and name.startswith(prefix + "pooler."):
            continue
        named[name] = tensor
    return named


def _named_float_tensors(module: nn.Module):
    for name, t in list(module.named_parameters()) + list(
            module.named_buffers()):
        if t.is_floating_point():
            yield name, t
