"""Linear layers with weights packed once, for the CPU ``inductor`` path.

A decode step on the CPU is bound by reading the weights: every step
multiplies a few activation rows (one per sequence) by every weight matrix
of the model.  MKL's matrix-vector and small-matrix products read those
weights at 13-17 GB/s on the reference machine, against 20-22 GB/s for a
plain sum.  ``spyre_kernels::packed_linear`` packs each weight once, at load
time, into contiguous column blocks and multiplies up to 12 rows per pass from
registers, which streams them at 18-20 GB/s.

The kernel is a ``torch.library`` op of the project's native extension
(``vllm.spyre_kernels.ops``, which builds it on first use beside the
attention kernels).  Inductor calls it like any other external kernel, so
one packed copy of the weights serves the graphs of every warm-up shape.

A prompt is another matter: its many rows make the product bound by
arithmetic, not by reading.  Where the CPU has AMX (``amx_bf16``), the
kernel multiplies a bfloat16 layer's inputs of 16 rows or more on AMX
tiles, reading the same packed weight (its blocks are AMX weight tiles
side by side), so a prompt gets the tiles' rate and the weight is held
once.

Where the extension cannot be built, ``bf16_linears`` gives bfloat16
products on oneDNN instead (``Bf16Linear``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

#: Output columns per packed block; must match kBlock in
#: ``vllm/spyre_kernels/linear.cpp``.
BLOCK = 32


def onednn_bf16_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x times a bfloat16 ``weight`` on oneDNN (AMX or ``avx512_bf16``
    where the CPU has them): x rounded to bfloat16, the product rounded to
    bfloat16 and returned in x's dtype, the bias added after."""
    y = torch.nn.functional.linear(x.to(torch.bfloat16), weight).to(x.dtype)
    return y if bias is None else y + bias


#: Bytes of a weight's blocks moved through one scratch buffer at a time
#: when a weight is packed in its own storage (``pack_weight``): a few
#: blocks, small enough to stay in a core's cache.
_IN_PLACE_CHUNK = 1 << 20


def pack_weight(weight: torch.Tensor,
                in_place: bool = False) -> torch.Tensor:
    """float32 [N, K] -> [ceil(N / BLOCK), K, BLOCK], zero-padded: block b
    holds output columns b * BLOCK ... b * BLOCK + BLOCK - 1, one row per
    input feature.  bfloat16 (K even) -> [ceil(N / BLOCK), K / 2, 2 *
    BLOCK]: one row per pair of input features, the pair's two weights of
    each output side by side.

    With ``in_place`` the caller gives the weight up: when it needs no
    padding and owns its storage (``owns_storage``), the packed layout is
    written over it and the result shares that storage.  Each block of 32
    rows is the same bytes before and after, so the blocks move a few at a
    time through a small buffer and no second copy of the weight is
    allocated (a fresh one costs a page fault every 4 KiB, which held a
    load's packing to about a third of the in-place rate)."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    # bfloat16: each pair moves as one 32-bit word (a transpose of words
    # copies faster than a permutation of 16-bit values).
    bf16 = weight.dtype == torch.bfloat16
    if in_place and n % BLOCK == 0 and owns_storage(weight):
        words = (weight.view(torch.int32) if bf16 else weight) \
            .view(blocks, BLOCK, -1)
        width = words.shape[2]
        per = max(1, _IN_PLACE_CHUNK // (BLOCK * width * 4))
        scratch = words.new_empty(min(per, blocks) * BLOCK * width)
        for start in range(0, blocks, per):
            rows = words[start:start + per]
            moved = scratch[:rows.numel()].view(rows.shape[0], width, BLOCK)
            moved.copy_(rows.transpose(1, 2))
            rows.view(-1).copy_(moved.view(-1))
        return words.view(blocks, width, BLOCK).view(weight.dtype)
    if n % BLOCK:
        padded = weight.new_zeros(blocks * BLOCK, k)
        padded[:n] = weight
    else:  # no padding: the layout's one copy is the permutation's
        padded = weight.contiguous()
    words = padded.view(torch.int32) if bf16 else padded
    packed = words.view(blocks, BLOCK, -1).transpose(1, 2).contiguous() \
        .view(weight.dtype)
    # Never a view of the weight (which a tied embedding may share).
    return packed.clone() if packed.data_ptr() == weight.data_ptr() \
        else packed


def pack_held(weight: torch.Tensor, dtype: torch.dtype,
              in_place: bool = False) -> torch.Tensor:
    """``weight`` held in ``dtype`` and packed (``pack_weight``): in place
    where the conversion made a copy, which is the caller's own, or where
    the caller gives the weight itself up (``in_place``)."""
    held = weight.detach().to(dtype)
    return pack_weight(held, in_place=in_place or
                       held.data_ptr() != weight.data_ptr())


def owns_storage(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is the whole of a storage PyTorch allocated (not
    a view into a larger tensor, nor a memory-mapped file's bytes), so that
    it may be overwritten in place by a caller that holds its only
    reference."""
    storage = weight.untyped_storage()
    return (weight.is_contiguous() and weight.storage_offset() == 0 and
            storage.nbytes() == weight.numel() * weight.element_size() and
            storage.resizable() and weight.dtype in (torch.float32,
                                                     torch.bfloat16))


def packable(linear: nn.Linear, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this layer (its weight float32, or already
    in ``dtype`` as a bfloat16 checkpoint is read) with its weight held in
    ``dtype``: float32, or bfloat16 with an even number of input
    features."""
    return linear.weight.dtype in (torch.float32, dtype) and (
        dtype == torch.float32 or
        (dtype == torch.bfloat16 and linear.in_features % 2 == 0))


class PackedLinear(nn.Module):
    """Drop-in for a float32 ``nn.Linear`` (no autograd; its weight may be
    read in bfloat16 already, ``spyre_loader.hold``), its weight packed
    in float32 or, with ``dtype=torch.bfloat16``, in bfloat16: then the
    inputs are rounded to bfloat16 and the products summed in float32, the
    output staying float32.  ``tied_to`` names the model parameter the
    weight was tied to (an embedding), if any: the packed copy is refreshed
    from it when weights are updated in place (``spyre_weight_update``)."""

    def __init__(self, linear: nn.Linear, tied_to: Optional[str] = None,
                 dtype: torch.dtype = torch.float32,
                 in_place: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.tied_to = tied_to
        with torch.no_grad():
            self.register_buffer(
                "packed", pack_held(linear.weight, dtype, in_place))
            bias = linear.bias
            self.register_buffer(
                "bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.spyre_kernels.packed_linear(
            x, self.packed, self.out_features, self.bias)

    @torch.no_grad()
    def repack(self, weight: torch.Tensor) -> None:
        """Packs ``weight`` [out_features, in_features] into the packed
        buffer in place, so compiled graphs see it at their next call."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} for a packed layer "
                f"of {self.out_features} x {self.in_features}")
        self.packed.copy_(pack_weight(weight.to(self.packed.dtype)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, "
                f"out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def plain_linear_types() -> tuple[type, ...]:
    """Linear classes whose forward is exactly ``nn.Linear``'s.  FMS's
    tensor-parallel head adds a gather to it and is left alone."""
    from fms.modules.head import LinearClassificationHead
    return (nn.Linear, LinearClassificationHead)


def pack_linears(model: nn.Module,
                 dtype: torch.dtype = torch.float32) -> int:
    """Replaces every plain float32 linear layer of ``model`` that the
    kernel takes in ``dtype`` (``packable``) with a ``PackedLinear`` holding
    its weight in ``dtype``; returns how many.  A weight tied to an
    embedding stays in place for the embedding, and the layer gets its own
    packed copy, which remembers the parameter it was tied to."""
    swaps = _packable_children(model, dtype)
    owners = _parameter_owners(model)
    sharers = _storage_sharers(model)
    count = len(swaps)
    # Each layer's weight is packed in its own storage where nothing else
    # holds it, else its old weight is freed as soon as its packed copy
    # exists: the model never holds two copies of more than one layer.
    swaps.reverse()
    while swaps:
        qualified, parent, name, child = swaps.pop()
        others = [n for n in owners.get(id(child.weight), [])
                  if not n.startswith(qualified + ".")]
        alone = not others and \
            sharers[child.weight.untyped_storage().data_ptr()] == 1
        setattr(parent, name,
                PackedLinear(child, tied_to=others[0] if others else None,
                             dtype=dtype, in_place=alone))
        del child
    return count


def packed_alone(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """The names of the weights ``pack_linears`` will pack in ``dtype``
    that belong to their layer alone (not a head tied to the embedding):
    known before the weights are read, on a model on the meta device."""
    owners = _parameter_owners(model)
    return {f"{qualified}.weight" for qualified, _, _, child in
            _packable_children(model, dtype)
            if len(owners[id(child.weight)]) == 1}


def _packable_children(model: nn.Module, dtype: torch.dtype) -> list:
    """(qualified name, parent, name, layer) of every plain linear layer
    of ``model`` the kernel takes in ``dtype``."""
    plain = plain_linear_types()
    return [(f"{prefix}.{name}" if prefix else name, parent, name, child)
            for prefix, parent in model.named_modules()
            for name, child in parent.named_children()
            if type(child) in plain and packable(child, dtype)]


def _storage_sharers(model: nn.Module) -> dict[int, int]:
    """How many distinct tensors of ``model`` (parameters and buffers)
    use each storage, by the storage's address."""
    tensors = {id(t): t for t in model.parameters()}
    tensors.update((id(t), t) for t in model.buffers())
    sharers: dict[int, int] = {}
    for t in tensors.values():
        ptr = t.untyped_storage().data_ptr()
        sharers[ptr] = sharers.get(ptr, 0) + 1
    return sharers


def _parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter goes by (a tied one has several)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    return owners


class Bf16Linear(nn.Module):
    """A linear layer whose matrix product runs on the CPU's bfloat16
    instructions (oneDNN through PyTorch): the weight is kept in bfloat16
    and the input rounded to it, while the output, the bias and so the
    residual stream, norms and softmax around it stay float32.  Half the
    weight bytes and, where the CPU has ``avx512_bf16``, about 2.8x the
    float32 product's rate on encoder-sized products."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(
            linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if linear.bias is None else nn.Parameter(
            linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_bf16_linear(x, self.weight, self.bias)


def bf16_linears(model: nn.Module) -> int:
    """Replaces every plain float32 linear layer of ``model`` (no tied
    weights) with a ``Bf16Linear``; returns how many."""
    plain = plain_linear_types()
    swaps = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) in plain and
             child.weight.dtype in (torch.float32, torch.bfloat16)]
    for parent, name in swaps:
        setattr(parent, name, Bf16Linear(getattr(parent, name)))
    return len(swaps)


def widen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Widens to ``dtype`` the weights of the plain linear layers left in a
    narrower dtype (read as a bfloat16 checkpoint is, then neither packed
    nor put on oneDNN: an odd number of input features); returns how
    many."""
    plain = plain_linear_types()
    layers = [m for m in model.modules() if type(m) in plain and
              m.weight.is_floating_point() and m.weight.dtype != dtype]
    for m in layers:
        m.weight = nn.Parameter(m.weight.detach().to(dtype),
                                requires_grad=False)
    return len(layers)
