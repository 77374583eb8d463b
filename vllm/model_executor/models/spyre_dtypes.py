"""The dtypes a Spyre model is served and held in.

A card holds a model in the dtype served.  The CPU backends serve float32
and bfloat16 only, and hold a bfloat16 model's matrix-product weights (and,
for a decoder, its key/value cache) in bfloat16 with everything else in
float32: the bytes a step reads halve while norms, softmax and the residual
stream keep float32's precision.  Decoders (``precision_of``) and encoders
(``encoder_dtype``) read their dtypes here; so does the memory estimate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES_ON_CPU = (torch.float32, torch.bfloat16)


def serving_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype a model is served in: the configured one, except on the
    CPU backends, which serve other dtypes than float32 and bfloat16 in
    float32."""
    if backend != "sendnn" and dtype not in _DTYPES_ON_CPU:
        return torch.float32
    return dtype


@dataclass(frozen=True)
class Precision:
    """Where a served dtype is held."""

    #: The model's own tensors: embeddings, norms, the residual stream and
    #: every activation between matrix products.
    model: torch.dtype
    #: Linear-layer weights (and so the inputs of their products).
    linear: torch.dtype
    #: The key/value cache.
    kv: torch.dtype


def precision_of(dtype: torch.dtype, backend: str) -> Precision:
    """bfloat16 on the CPU backends keeps the weights of the matrix
    products and the key/value cache in bfloat16, the bytes a decode step
    reads, and everything else in float32; a card holds all of it in the
    dtype served."""
    served = serving_dtype(dtype, backend)
    if backend != "sendnn" and served == torch.bfloat16:
        return Precision(torch.float32, torch.bfloat16, torch.bfloat16)
    return Precision(served, served, served)


def encoder_dtype(dtype: torch.dtype,
                  backend: str) -> tuple[torch.dtype, bool]:
    """The dtype an encoder's tensors are held in, and whether its matrix
    products run in bfloat16.  ``--dtype bfloat16`` on the CPU backends
    keeps the tensors float32 but runs every matrix product in bfloat16
    (``Bf16Linear``, ``ATTN_NAME_BF16``): embeddings then stay within
    cosine 0.9999 of float32 (docs/embeddings.md), which a model held
    wholly in bfloat16 does not."""
    if backend != "sendnn" and dtype == torch.bfloat16:
        return torch.float32, True
    return serving_dtype(dtype, backend), False


def stored_dtypes(model_dir: str) -> set[torch.dtype]:
    """The dtypes of the floating-point tensors of the safetensors files
    in ``model_dir`` (their headers only are read); empty when it holds
    none."""
    import json
    import struct
    from pathlib import Path
    names = {"BF16": torch.bfloat16, "F16": torch.float16,
             "F32": torch.float32, "F64": torch.float64}
    found: set[torch.dtype] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size, ) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        found.update(names[info["dtype"]] for key, info in header.items()
                     if key != "__metadata__" and info["dtype"] in names)
    return found


def load_dtype(precision: Precision, stored: set[torch.dtype]) -> torch.dtype:
    """The dtype a checkpoint's tensors are read into: the linear weights'
    dtype where every stored float already is in it (a bfloat16
    checkpoint served in bfloat16: the model's own float32 tensors are
    widened afterwards, exactly, and no float32 copy of a linear layer is
    ever made); else the model's dtype, which rounds nothing that serving
    keeps wider."""
    if stored == {precision.linear}:
        return precision.linear
    return precision.model


def reads_linears_narrow(precision: Precision, stored: set[torch.dtype],
                         tp_size: int, packed: bool) -> bool:
    """Whether a checkpoint's linear weights are held in
    ``precision.linear`` from the read on, so that no float32 copy of them
    is ever made: read so where every stored float already is in it
    (``load_dtype``); else, where the kernels pack them (``packed``) and
    this rank reads the whole model, each converted as it is read
    (``spyre_fms_loader``: a float32 checkpoint served in bfloat16)."""
    if precision.linear == precision.model:
        return False
    return load_dtype(precision, stored) == precision.linear or (
        packed and tp_size == 1)
