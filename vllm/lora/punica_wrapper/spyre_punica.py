"""The LoRA products of a Spyre step, inside its compiled graphs.

vLLM's LoRA layers (``vllm/lora/layers.py``) wrap a model's linear layers,
its token embedding and its logits, and ask the platform's punica wrapper
to add each row's adapter product to the base layer's output.  vLLM's CPU
wrapper chooses its ops in Python from the step's kind (prefill or decode)
and whether any adapter is active, and gathers one weight matrix per token;
in a graph compiled once per shape (``spyre_compile``), such choices would
be fixed at warm-up.

``PunicaWrapperSpyre`` runs the same product with no branch and no shape
that depends on the step: every adapter slot at once, each token's slot
selected by a one-hot mask built inside the graph from the step's slot
index per token (-1: no adapter).  For ``T`` tokens, ``S`` slots and rank
``r``::

    h = (x @ A_all^T).view(T, S, r) * onehot(slot)[:, :, None] * scale
    y += h.view(T, S * r) @ B_all

``A_all`` (``[S * r, in]``) and ``B_all`` (``[S * r, out]``) are the
stacked adapters every LoRA layer holds, so a step runs two small products
per projection for all its rows, whatever adapters they use (the punica
shrink and expand, batched over the slots).  Where the model runs on the
project's C++ kernels, one op per layer adds every slice's product to the
base layer's output in place (``spyre_kernels::lora_add_``): each row
multiplied by its own slot's matrices only, the rows on one slot together,
in two threaded passes (each adapter's B in tiles of outputs, ``tile_b_``,
laid out so by ``spyre_lora`` when it is copied into a slot), where
the ops above are a dozen per slice (in eager, each one a call; in
inductor, thousands of nodes more in every graph of a 30-layer model, and
minutes more to compile it).  Slots and ranks are fixed at
start-up (``--max-loras``, ``--max-lora-rank``): loading or removing an
adapter copies into the stacked tensors in place, and the graphs compiled
at warm-up serve every mix of adapters.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase


def _add_masked(y: torch.Tensor, x: torch.Tensor, a: Optional[torch.Tensor],
                b: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """``y[t] += scale * x[t] @ a[slot[t]]^T @ b[slot[t]]^T`` for every
    token ``t`` with ``slot[t] >= 0``; ``a`` None: ``x`` is already the
    shrunk ``[T, r]`` product (the embedding's).  ``a``: ``[S, 1, r, in]``
    (or ``[S, r, in]``), ``b``: ``[S, 1, out, r]``; ``y``: ``[T, out']``
    with ``out' <= out`` (padding of the adapter's vocabulary)."""
    tokens = x.shape[0]
    b = b.reshape(b.shape[0], b.shape[-2], b.shape[-1])
    n_slots, out, rank = b.shape
    dtype = torch.float32
    onehot = (slots[:tokens].unsqueeze(1) == torch.arange(
        n_slots, device=slots.device).unsqueeze(0)).to(dtype)
    if a is None:
        h = x.to(dtype).unsqueeze(1) * onehot.unsqueeze(2)
    else:
        a = a.reshape(n_slots * rank, a.shape[-1])
        h = (x.to(dtype) @ a.to(dtype).t()).view(tokens, n_slots, rank)
        h = h * onehot.unsqueeze(2)
    if scale != 1.0:
        h = h * scale
    delta = h.reshape(tokens, n_slots * rank) @ b.to(dtype).transpose(
        1, 2).reshape(n_slots * rank, out)
    width = min(out, y.shape[-1])
    y[:, :width] += delta[:, :width].to(y.dtype)


#: Outputs per tile of a stacked B as the C++ kernel reads it.
TILE = 16


def tile_b_(b: torch.Tensor, slot: int) -> None:
    """Lays slot ``slot`` of a stacked B (``[S, 1, n, r]`` or ``[S, n,
    r]``, contiguous) out in place as ``lora_add_`` reads it, from the
    order vLLM's ``set_lora`` writes (each output's ``r`` values): tiles of
    ``TILE`` adjacent outputs, each tile its ``r`` rows of ``TILE`` values
    (the last tile, of ``n % TILE`` outputs, its ``r`` rows of those), so
    that a tile is one contiguous block and its rows vectors of outputs.
    The tensor keeps its shape; only the kernel reads it this way."""
    n, r = b.shape[-2], b.shape[-1]
    rows = b[slot].reshape(n, r).clone()
    flat = b[slot].view(-1)
    full = n - n % TILE
    flat[:full * r].view(full // TILE, r, TILE).copy_(
        rows[:full].view(full // TILE, TILE, r).transpose(1, 2))
    if full < n:
        flat[full * r:].view(r, n - full).copy_(rows[full:].t())


class PunicaWrapperSpyre(PunicaWrapperBase):
    """vLLM's punica wrapper for the Spyre graphs (module docstring).

    ``update_metadata`` (vLLM's, unchanged) fills the slot index of every
    token of the step (``_token_lora_indices``) and of every row whose
    logits are computed (``sampler_indices``) before each forward; the
    products below read the first ``T`` entries, ``T`` the rows of their
    input, which every compiled shape fixes."""

    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: Union[torch.device, str], **kwargs) -> None:
        PunicaWrapperBase.__init__(self, max_num_batched_tokens, max_batches,
                                   device)
        #: Whether the products run on the C++ kernel (``lora_add_``),
        #: set by ``spyre_lora`` where the model runs on the kernels.
        self.native = False
        #: Per slot, whether its adapter adapts the output head (set by
        #: ``spyre_lora`` as it fills the slot): while none does, the
        #: head's product (zero) is not computed.
        self.head_slots: dict[int, bool] = {}
        # Padding and inactive rows: no adapter, before the first mapping.
        self._token_lora_indices.fill_(-1)
        self._sampler_indices.fill_(-1)
        self._embeddings_indices.zero_()

    def update_metadata(self, mapping, lora_index_to_id, max_loras,
                        vocab_size, extra_vocab_size, **kwargs) -> None:
        self._update_base_metadata(mapping, lora_index_to_id, max_loras,
                                   vocab_size, extra_vocab_size)
        self.is_prefill = mapping.is_prefill

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        raise NotImplementedError("PunicaWrapperSpyre adds whole products "
                                  "(add_lora_linear)")

    def add_expand(self, y, x, lora_b_stacked, lora_bias_stacked,
                   output_slices, offset_start=0, add_inputs=True, **kwargs):
        raise NotImplementedError("PunicaWrapperSpyre adds whole products "
                                  "(add_lora_linear)")

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor,
                        lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...],
                        lora_bias_stacked: Optional[tuple[torch.Tensor,
                                                          ...]],
                        scale: float, output_slices: tuple[int, ...],
                        **kwargs) -> None:
        """Each slice's adapter product added to its columns of ``y``."""
        if lora_bias_stacked is not None:
            raise NotImplementedError(
                "LoRA adapters with biases are not supported on Spyre")
        # Already [tokens, features] on vLLM's model code: no view (in a
        # graph run by eager, each would be one more call per layer).
        flat_y = y if y.dim() == 2 else y.view(-1, y.shape[-1])
        flat_x = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        slots = self._token_lora_indices
        if self.native:
            # Three slices a call (the op's most), at their columns.
            offset = 0
            for i in range(0, len(output_slices), 3):
                pairs: list = []
                for a, b in zip(lora_a_stacked[i:i + 3],
                                lora_b_stacked[i:i + 3]):
                    pairs += [a, b]
                pairs += [None] * (6 - len(pairs))
                widths = list(output_slices[i:i + 3])
                torch.ops.spyre_kernels.lora_add_(
                    flat_y[:, offset:] if offset else flat_y, flat_x,
                    *pairs, slots, scale,
                    *widths, *[0] * (3 - len(widths)))
                offset += sum(widths)
            return
        offset = 0
        for a, b, width in zip(lora_a_stacked, lora_b_stacked,
                               output_slices):
            _add_masked(flat_y[:, offset:offset + width], flat_x, a, b,
                        slots, scale)
            offset += width

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor,
                           lora_b_stacked: torch.Tensor,
                           add_inputs: bool = True, **kwargs) -> None:
        """The embedding's expand: ``x`` is each token's row of its
        adapter's A (looked up by the layer)."""
        _add_masked(y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1]), None,
                    lora_b_stacked, self._token_lora_indices, 1.0)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor,
                        lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale, **kwargs
                        ) -> None:
        """The output head's adapter product, one slot per row (run after
        the graph, on the rows whose logits are computed)."""
        if not any(self.head_slots.values()):
            return
        flat_y, flat_x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        if self.native:
            torch.ops.spyre_kernels.lora_add_(
                flat_y, flat_x, lora_a_stacked, lora_b_stacked, None, None,
                None, None, self._sampler_indices, scale, flat_y.shape[-1],
                0, 0)
            return
        _add_masked(flat_y, flat_x, lora_a_stacked, lora_b_stacked,
                    self.sampler_indices, scale)
