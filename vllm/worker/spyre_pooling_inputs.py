"""Pure functions that pack texts into the compiled shapes of a pooling
model (embeddings, cross-encoder scores).

A pooling shape is ``(prompt_len, batch_size)``: ``batch_size`` rows of
``prompt_len`` token slots, run once, generating nothing.  Many short texts
share one row: each text occupies consecutive slots of a row, its positions
count from the start of the text, and it attends only to its own tokens
(a block-diagonal mask), so packing changes no text's result.  Unused slots
are padding that attends only to itself.

The scheduler takes from its waiting queue the texts that fit one shape
together (``vllm.core.spyre_pooling_shapes``); the model runner calls
``plan_passes`` on the texts it receives to find the shape (and the slots)
again with the same first-fit rule, then ``packed_inputs`` to build the
tensors.  Nothing here touches a model or a scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vllm.config.spyre import WarmupShape
from vllm.core.spyre_pooling_shapes import (Placement,
                                            choose_pooling_shape,
                                            rejection_reason)


def plan_passes(
    lengths: Sequence[int], shapes: Sequence[WarmupShape]
) -> list[tuple[WarmupShape, list[int], list[Placement]]]:
    """Forward passes that run every text: ``(shape, indices into lengths,
    placements)``.  One pass on the cheapest shape holding them all, which
    is what a step chosen by ``select_texts`` gets; a set that no shape
    holds at once is split in two, recursively."""
    if not lengths:
        return []
    picked = choose_pooling_shape(lengths, shapes)
    if picked is not None:
        return [(picked[0], list(range(len(lengths))), picked[1])]
    if len(lengths) == 1:
        raise ValueError(rejection_reason(lengths[0], shapes))
    half = len(lengths) // 2
    passes = []
    for start, part in ((0, lengths[:half]), (half, lengths[half:])):
        for shape, indices, placements in plan_passes(part, shapes):
            passes.append((shape, [start + i for i in indices], placements))
    return passes


@dataclass(frozen=True)
class EncoderInputs:
    """Tensors of one packed forward pass of shape ``[B, L]``."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    token_type_ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L, L] bool: True = may attend
    #: [B, L] int64: the first slot of each slot's text (padding: itself),
    #: the same texts as the mask for the C++ attention kernel.
    text_starts: torch.Tensor
    gather: torch.Tensor  # [T] int64: flat slot of each text token, in order


def packed_inputs(texts: Sequence[Sequence[int]],
                  token_types: Sequence[Optional[Sequence[int]]],
                  shape: WarmupShape, placements: Sequence[Placement],
                  pad_id: int, first_position: int = 0) -> EncoderInputs:
    """The tensors of ``texts`` placed at ``placements`` in ``shape``.

    A text's positions run from ``first_position`` (RoBERTa numbers its
    positions after the padding id); its token types default to 0.
    ``gather`` lists, text after text, the flat slot (``row * L + slot``)
    of every token, so that the encoder's output ``[B * L, H]`` indexed by
    it is the texts' hidden states concatenated, as vLLM's poolers take
    them.
    """
    B, L = shape.batch_size, shape.prompt_len
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    token_type_ids = torch.zeros((B, L), dtype=torch.long)
    # Padding attends to itself only; each text to its own block.
    mask = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1)  # [B, L, L]
    text_starts = torch.arange(L).repeat(B, 1)  # [B, L]
    gather = []
    for i, (ids, types, at) in enumerate(zip(texts, token_types,
                                             placements)):
        n = len(ids)
        end = at.offset + n
        if end > L or at.row >= B:
            raise ValueError(f"text {i} of {n} tokens at {at} does not fit "
                             f"shape {shape}")
        input_ids[at.row, at.offset:end] = torch.tensor(ids)
        position_ids[at.row, at.offset:end] = torch.arange(
            first_position, first_position + n)
        if types:
            token_type_ids[at.row, at.offset:end] = torch.tensor(types)
        mask[at.row, at.offset:end, at.offset:end] = True
        text_starts[at.row, at.offset:end] = at.offset
        gather.append(torch.arange(at.row * L + at.offset, at.row * L + end))
    flat = torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long)
    return EncoderInputs(input_ids, position_ids, token_type_ids, mask,
                         text_starts, flat)
