"""Pure functions that turn requests into the fixed-shape tensors Spyre runs.

Spyre runs only graphs compiled at start-up, one set per warm-up shape
``(prompt_len, new_tokens, batch_size)``.  The scheduler uses
``select_batch`` to pick the next batch from its waiting queue; the model
runner uses ``choose_shape`` to find the same shape again from the batch it
receives, then ``prefill_inputs`` / ``decode_inputs`` to build the left-padded
token ids, attention masks and position ids of that shape.

Nothing here touches a model, a scheduler or global state: every function
takes plain values and is unit-tested on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vllm.platforms.spyre_config import WarmupShape


@dataclass(frozen=True)
class RequestSize:
    """What the scheduler needs to know of a request to place it."""

    prompt_len: int
    max_tokens: int


def fits(shape: WarmupShape, req: RequestSize) -> bool:
    """True if one request fits one row of ``shape``."""
    return (req.prompt_len <= shape.prompt_len
            and req.max_tokens <= shape.new_tokens)


def choose_shape(reqs: Sequence[RequestSize],
                 shapes: Sequence[WarmupShape]) -> Optional[WarmupShape]:
    """The cheapest shape that holds every request of ``reqs`` at once."""
    candidates = [
        s for s in shapes
        if len(reqs) <= s.batch_size and all(fits(s, r) for r in reqs)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda s: s.cost)


def select_batch(
    waiting: Sequence[RequestSize], shapes: Sequence[WarmupShape]
) -> Optional[tuple[WarmupShape, list[int]]]:
    """Choose the next static batch from a waiting queue in arrival order.

    The oldest request is always in the batch, so a request that fits some
    shape is never starved.  For every shape that fits the oldest request,
    the batch takes the waiting requests that fit that shape, in arrival
    order, up to its batch size; the shape that admits the most requests
    wins, and among equals the cheapest.  Finally the batch runs on the
    cheapest shape that holds it (never more expensive than the winner).

    Returns ``(shape, indices into waiting)``, or None if ``waiting`` is
    empty or its oldest request fits no shape.
    """
    if not waiting:
        return None
    best: Optional[tuple[int, tuple, list[int]]] = None
    for shape in shapes:
        if not fits(shape, waiting[0]):
            continue
        chosen = [i for i, r in enumerate(waiting)
                  if fits(shape, r)][:shape.batch_size]
        key = (-len(chosen), shape.cost)
        if best is None or key < best[:2]:
            best = (key[0], key[1], chosen)
    if best is None:
        return None
    indices = best[2]
    shape = choose_shape([waiting[i] for i in indices], shapes)
    assert shape is not None
    return shape, indices


def rejection_reason(req: RequestSize,
                     shapes: Sequence[WarmupShape]) -> Optional[str]:
    """Why a request can never be served, or None if some shape fits it."""
    if any(fits(s, req) for s in shapes):
        return None
    listed = ", ".join(str(s) for s in shapes)
    return (f"The request (prompt length {req.prompt_len}, max_tokens "
            f"{req.max_tokens}) fits none of the compiled Spyre warm-up "
            f"shapes: {listed}. Shorten the prompt or lower max_tokens, or "
            "add a larger shape to VLLM_SPYRE_WARMUP_PROMPT_LENS / "
            "VLLM_SPYRE_WARMUP_NEW_TOKENS / VLLM_SPYRE_WARMUP_BATCH_SIZES.")



def parallel_samples_reason(n: int,
                            shapes: Sequence[WarmupShape]) -> Optional[str]:
    """Why the ``n`` samples of one request (``n`` or ``best_of``) can never
    share a batch, or None."""
    largest = max(s.batch_size for s in shapes)
    if n <= largest:
        return None
    return (f"n={n} parallel samples of one request are more than the "
            f"largest batch size {largest} of the compiled Spyre warm-up "
            "shapes. Lower n (or best_of), or add a larger batch size to "
            "VLLM_SPYRE_WARMUP_BATCH_SIZES.")

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
                   pad_id: int) -> StepInputs:
    """Left-pad ``prompts`` into a ``[batch_size, prompt_len]`` prefill.

    Rows past ``len(prompts)`` are filler rows holding a single pad token.
    Pad positions attend only to earlier pads (never to nothing, which
    would give NaN rows); real tokens attend causally to real tokens only.
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
    mask = causal.unsqueeze(0) & same_kind  # [B, P, P]
    return StepInputs(input_ids, position_ids, mask, torch.arange(P),
                      shape.prompt_len + shape.new_tokens)


def decode_inputs(last_tokens: Sequence[int], prompt_lens: Sequence[int],
                  shape: WarmupShape, step: int) -> StepInputs:
    """Inputs of decode step ``step`` (1 = the first token after prefill).

    ``last_tokens`` and ``prompt_lens`` hold one entry per row of the
    shape (filler and finished rows included).  The step writes cache slot
    ``prompt_len + step - 1`` and attends over the whole cache of
    ``prompt_len + new_tokens`` slots: the real prompt tokens, the tokens
    generated so far and its own; slots not written yet are masked out.
    Every step of a shape thus has the same tensor shapes.
    """
    return DecodeSteps(prompt_lens, shape).inputs(last_tokens, step)


class DecodeSteps:
    """``decode_inputs`` for every step of one batch.

    Everything but the tokens is fixed when the batch starts: the masks,
    positions and cache slots of all ``new_tokens - 1`` decode steps are
    built then, in one go, and each step only adds its tokens.
    """

    def __init__(self, prompt_lens: Sequence[int],
                 shape: WarmupShape) -> None:
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
        # One tensor per step, each its own contiguous allocation.
        self._masks = [m.unsqueeze(1).clone() for m in mask]  # [B, 1, kv]
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
