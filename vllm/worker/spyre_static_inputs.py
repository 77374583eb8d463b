"""Pure functions that turn requests into the fixed-shape tensors Spyre runs.

Spyre runs only graphs compiled at start-up, one set per warm-up shape
``(prompt_len, new_tokens, batch_size)``.  The model runner finds the shape
of the batch it receives (``vllm.core.spyre_static_shapes``, the rules
the scheduler chose the batch by), then uses ``prefill_inputs`` /
``decode_inputs`` to build the left-padded token ids, attention masks and
position ids of that shape.

Nothing here touches a model, a scheduler or global state: every function
takes plain values and is unit-tested on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm.attention.ops.spyre_torch_ops import windowed
from vllm.config.spyre import WarmupShape


@dataclass(frozen=True)
class StepInputs:
    """Tensors of one forward pass of a fixed shape.

    The key/value cache of a batch holds ``prompt_len + new_tokens`` slots
    (``cache_len``); a step writes its keys and values into the slots
    ``cache_slots``.  A prefill attends over its own ``prompt_len`` tokens,
    a decode step over the whole cache (``kv_len`` below)."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L, kv_len] bool: True = may attend
    cache_slots: torch.Tensor  # [L] int64: cache slots this step writes
    cache_len: int  # slots of the batch's cache: prompt_len + new_tokens


def prefill_inputs(prompts: Sequence[Sequence[int]], shape: WarmupShape,
                   pad_id: int, window: int = 0) -> StepInputs:
    """Left-pad ``prompts`` into a ``[batch_size, prompt_len]`` prefill.

    Rows past ``len(prompts)`` are filler rows holding a single pad token.
    Pad positions attend only to earlier pads (never to nothing, which
    would give NaN rows); real tokens attend causally to real tokens only,
    with a sliding ``window`` (> 0) to the last ``window`` of them.
    Real positions count from 0 after the pads; pads sit at position 0.
    """
    if len(prompts) > shape.batch_size:
        raise ValueError(f"{len(prompts)} prompts exceed the batch size of "
                         f"shape {shape}")
    B, P = shape.batch_size, shape.prompt_len
    lens = [len(p) for p in prompts] + [1] * (B - len(prompts))
    if max(lens) > P:
        raise ValueError(f"a prompt of {max(lens)} tokens exceeds the "
                         f"prompt length of shape {shape}")
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)  # [B, P]
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, P - len(prompt):] = torch.tensor(prompt)
    n = torch.tensor(lens).unsqueeze(1)  # [B, 1]
    col = torch.arange(P).unsqueeze(0)  # [1, P]
    is_real = col >= P - n  # [B, P]
    position_ids = (col - (P - n)).clamp(min=0)  # [B, P]
    causal = torch.ones(P, P, dtype=torch.bool).tril()  # [P, P]
    same_kind = is_real.unsqueeze(2) == is_real.unsqueeze(1)  # [B, P, P]
    mask = windowed(causal.unsqueeze(0) & same_kind, torch.arange(P),
                    window)  # [B, P, P]
    return StepInputs(input_ids, position_ids, mask, torch.arange(P),
                      shape.prompt_len + shape.new_tokens)


def decode_inputs(last_tokens: Sequence[int], prompt_lens: Sequence[int],
                  shape: WarmupShape, step: int,
                  window: int = 0) -> StepInputs:
    """Inputs of decode step ``step`` (1 = the first token after prefill).

    ``last_tokens`` and ``prompt_lens`` hold one entry per row of the
    shape (filler and finished rows included).  The step writes cache slot
    ``prompt_len + step - 1`` and attends over the whole cache of
    ``prompt_len + new_tokens`` slots: the real prompt tokens, the tokens
    generated so far and its own; slots not written yet are masked out.
    Every step of a shape thus has the same tensor shapes.  A sliding
    ``window`` (> 0) narrows the mask to the last ``window`` slots: a row's
    real tokens are contiguous in its cache, so slots are as far apart as
    their tokens.
    """
    return DecodeSteps(prompt_lens, shape, window).inputs(last_tokens, step)


class DecodeSteps:
    """``decode_inputs`` for every step of one batch.

    Everything but the tokens is fixed when the batch starts: the masks,
    positions and cache slots of all ``new_tokens - 1`` decode steps are
    built then, in one go, and each step only adds its tokens.
    """

    def __init__(self, prompt_lens: Sequence[int], shape: WarmupShape,
                 window: int = 0) -> None:
        B, P, G = shape.batch_size, shape.prompt_len, shape.new_tokens
        if len(prompt_lens) != B:
            raise ValueError(
                f"decode needs exactly {B} rows for shape {shape}")
        self.shape = shape
        kv_len = P + G
        steps = torch.arange(1, G).view(-1, 1, 1)  # [G-1, 1, 1]
        n = torch.tensor(prompt_lens).view(1, B, 1)  # [1, B, 1]
        col = torch.arange(kv_len).view(1, 1, kv_len)  # [1, 1, kv_len]
        written = col < P + steps  # [G-1, 1, kv_len]
        mask = ((col >= P - n) | (col >= P)) & written  # [G-1, B, kv_len]
        # One tensor per step, each its own contiguous allocation, narrowed
        # to the sliding window (the step writes slot P + step - 1).
        self._masks = [windowed(m.unsqueeze(1), torch.tensor([P + s]),
                                window).clone()
                       for s, m in enumerate(mask)]  # [B, 1, kv]
        self._positions = [p.clone() for p in n[0] + steps - 1]  # [B, 1]
        self._slots = [torch.tensor([P + s - 1]) for s in range(1, G)]
        self._kv_len = kv_len

    def inputs(self, last_tokens: Sequence[int], step: int) -> StepInputs:
        B = self.shape.batch_size
        if len(last_tokens) != B:
            raise ValueError(
                f"decode needs exactly {B} rows for shape {self.shape}")
        if not 1 <= step < self.shape.new_tokens:
            raise ValueError(
                f"decode step {step} is outside shape {self.shape}")
        input_ids = torch.tensor(last_tokens, dtype=torch.long).unsqueeze(1)
        return StepInputs(input_ids, self._positions[step - 1],
                          self._masks[step - 1], self._slots[step - 1],
                          self._kv_len)
