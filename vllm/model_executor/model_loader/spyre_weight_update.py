"""New weights loaded in place into a loaded, compiled Spyre model.

Co-located jobs (a trainer and vLLM in one ``torchrun`` job, one engine per
rank) push fresh weights into the engine after each training step with
``LLM.collective_rpc("update_weights_in_place", args=(state_dict, ))``.
The worker hands the state dict to ``SpyreCausalLM.update_weights_in_place``
(``FmsModelCode.update_weights_in_place``), which uses this module:

* ``CheckpointLayout.read`` takes the names and shapes the model was
  loaded from (its safetensors headers, Hugging Face naming);
* ``check_state_dict`` refuses, before anything is copied, a state dict
  with a missing, extra or wrongly shaped tensor, naming it, so a refused
  update leaves the old weights whole;
* ``load_in_place`` copies the tensors into the model's own parameters
  and buffers, one layer at a time, through FMS's checkpoint adapter (the
  same naming and fusing the model was loaded with) and FMS's tensor
  parallel sharding (each rank keeps its shard of the full tensors it is
  given).  Nothing is replaced, so every compiled graph, which reads the
  weights as inputs, sees the new values at its next call: nothing is
  recompiled and no second copy of the weights is kept.  Layers packed for
  the CPU kernel (``spyre_linear.PackedLinear``) get a staging weight
  for the copy, packed in place and dropped before the next layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from vllm.model_executor.layers.spyre_linear import PackedLinear

#: Hugging Face names of the output head, present in a state dict of a
#: model whose head is tied to its embedding (``model.state_dict()``) but
#: not in its checkpoint.
_TIED_HEADS = ("lm_head.weight", )
#: Hugging Face names of the token embedding a head is tied to.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight")

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class CheckpointLayout:
    """What a state dict must hold: name -> shape, in Hugging Face naming;
    ``optional`` names may be present (a tied head) and are not loaded."""

    shapes: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]]

    @classmethod
    def read(cls, model_dir: str, hf_config) -> "CheckpointLayout":
        """From the safetensors headers of ``model_dir``."""
        from safetensors import safe_open
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise NotImplementedError(
                f"in-place weight updates need a safetensors checkpoint; "
                f"{model_dir} has none")
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        optional = {}
        embedding = next((s for n, s in shapes.items()
                          if n.endswith(_EMBEDDINGS)), None)
        if getattr(hf_config, "tie_word_embeddings", False) and embedding:
            optional = {n: embedding for n in _TIED_HEADS if n not in shapes}
        return cls(shapes, optional)


def check_state_dict(state_dict: Mapping[str, Any],
                     layout: CheckpointLayout) -> None:
    """``ValueError`` naming every tensor that is missing, extra, not a
    floating-point tensor with data, or of the wrong shape."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"update_weights_in_place takes a mapping of tensor names to "
            f"tensors, not {type(state_dict).__name__}")
    known = {**layout.shapes, **layout.optional}
    problems = []
    missing = sorted(set(layout.shapes) - set(state_dict))
    if missing:
        problems.append(f"missing {_names(missing)}")
    extra = sorted(set(state_dict) - set(known))
    if extra:
        problems.append(f"not in the model: {_names(extra)}")
    for name in sorted(set(state_dict) & set(known)):
        tensor = state_dict[name]
        wrong = _not_a_float_tensor(tensor)
        if wrong:
            problems.append(f"{name} is {wrong}, not a floating-point "
                            "tensor")
        elif tuple(tensor.shape) != known[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the "
                            f"model's is {known[name]}")
    if problems:
        raise ValueError(
            "Refused the weight update, the model keeps its weights: " +
            "; ".join(problems) + ". Pass a state dict in Hugging Face "
            "naming with the full (unsharded) tensors of the checkpoint "
            "the model was loaded from.")


def _not_a_float_tensor(value: Any) -> Optional[str]:
    """What ``value`` is, when it is not a floating-point tensor with
    data."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.is_meta:
        return "a meta tensor (no data)"
    if not torch.is_floating_point(value):
        return f"a {value.dtype} tensor"
    return None


def _names(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _layer_of(name: str) -> Optional[int]:
    """The first integer component of a dotted name (its layer), if any."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def load_in_place(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                  layout: CheckpointLayout, *, architecture: str, source: str,
                  tensor_parallel: bool) -> int:
    """Copies a checked state dict into ``model``'s tensors, a layer at a
    time; returns how many checkpoint tensors were loaded."""
    from fms.utils.serialization import load_state_dict_into_model
    groups: dict[Optional[int], dict[str, torch.Tensor]] = {}
    for name in layout.shapes:
        groups.setdefault(_layer_of(name), {})[name] = state_dict[name]
    packed = [(name, m) for name, m in model.named_modules()
              if isinstance(m, PackedLinear)]
    with torch.no_grad():
        for layer, tensors in groups.items():
            staged = [(name, m) for name, m in packed
                      if _layer_of(name) == layer]
            for _, m in staged:
                # A plain attribute, not a parameter: FMS copies into it.
                m.weight = torch.full((m.out_features, m.in_features),
                                      float("nan"), dtype=m.packed.dtype)
            try:
                load_state_dict_into_model(
                    model, dict(tensors), architecture=architecture,
                    source=source,
                    distributed_strategy="tp" if tensor_parallel else None)
                for name, m in staged:
                    if m.tied_to is None:
                        _repack_filled(name, m)
            finally:
                for _, m in staged:
                    del m.weight
        for _, m in packed:
            if m.tied_to is not None:
                m.repack(model.get_parameter(m.tied_to))
    return sum(len(t) for t in groups.values())


def _repack_filled(name: str, layer: PackedLinear) -> None:
    """Packs a staging weight that the load filled; one left unfilled means
    the checkpoint's names did not reach this layer."""
    if torch.isnan(layer.weight).any():
        raise RuntimeError(
            f"the weight update did not fill the packed layer {name} (or "
            "gave it NaN values)")
    layer.repack(layer.weight)
